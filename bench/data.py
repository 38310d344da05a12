"""Data at corpus scale: tokenization throughput, cached start-up and peak RSS per rank, beside a tiny corpus.

    python bench/data.py [--sizes 32,256] [--keep DIR]

1. For each size (MB) a corpus is generated in a temporary directory (never committed): JSON lines, each a
   document of 20-200 consecutive lines of the bundled Shakespeare from a seeded random start; and a tiny
   corpus of 64 KB made the same way.
2. A 32k byte-level BPE is trained on the first corpus (plait's recipe: a bounded sample of it) and given to
   every run with --tokenizer_name; the model is a Llama with vocab_size 32768 (h=64, 2 layers), block 128.
3. Per corpus, `plait train --nproc_per_node 2 --max_steps 2` twice with a fresh --data_cache_dir: the first
   run tokenizes on local rank 0 (throughput = input MB / tokenizing seconds, from the cache's meta.json),
   the second starts from the cache. The tiny corpus is run the same way; its second run is the baseline.
   Peak RSS per rank is each worker's VmHWM (/proc/PID/status), polled every 50 ms.
4. At sizes <= 32 MB, the in-memory path this replaced (``training_blocks``: every rank tokenizes the whole
   corpus into one tensor), one process: its time and peak RSS (each rank of a run paid this).
5. The tokenizer alone (Rust ``encode_batch_fast`` over text already in memory, same batching): the ceiling
   for the throughput on this machine.
6. Cached start-up of the data alone: a fresh process times ``prepare_data`` (tokenizer load, cache key,
   cache check, blocks) against the warm cache, best of 3, so that the noise of whole runs on a shared
   machine does not swamp it; the runs' wall times are printed beside it.

Goals (issue 11): peak RSS per rank over the tiny corpus's <= 256 MiB at every size (not growing with the
corpus); cached start-up (second run's wall time) <= 5 s over the tiny corpus's; throughput >= 10 MB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
VOCAB, BLOCK, BATCH = 32768, 128, 2
GOAL_RSS_MIB, GOAL_STARTUP_S, GOAL_MBPS = 256, 5.0, 10.0


def make_corpus(path: Path, size_bytes: int, seed: int) -> int:
    """JSON lines of documents of consecutive Shakespeare lines until ``size_bytes``; returns documents."""
    from plait.data import default_corpus_path

    lines = default_corpus_path().read_text(encoding="utf-8").splitlines(keepends=True)
    rng, written, docs = random.Random(seed), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < size_bytes:
            start = rng.randrange(len(lines))
            record = json.dumps({"text": "".join(lines[start : start + rng.randrange(20, 200)])}) + "\n"
            f.write(record)
            written += len(record.encode())
            docs += 1
    return docs


def model_config(path: Path) -> Path:
    from transformers import LlamaConfig

    path.write_text(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=BLOCK).to_json_string())
    return path


def vm_hwm(pid: int) -> int:
    """Peak resident memory of a process so far, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) * 1024


def run_monitored(cmd: list[str], log: Path) -> tuple[float, dict[int, int]]:
    """Run ``cmd`` (which starts torchrun workers); returns (wall seconds, peak RSS per LOCAL_RANK)."""
    import psutil

    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        parent, ranks, peaks = psutil.Process(proc.pid), {}, {}
        while proc.poll() is None:
            try:
                children = parent.children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            for child in children:
                try:
                    if child.pid not in ranks:
                        ranks[child.pid] = child.environ().get("LOCAL_RANK")
                    rank = ranks[child.pid]
                    if rank is not None and "plait" in " ".join(child.cmdline()):
                        peaks[int(rank)] = max(peaks.get(int(rank), 0), vm_hwm(child.pid))
                except (psutil.Error, OSError, AttributeError):
                    pass
            time.sleep(0.05)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return wall, peaks


def train_command(config: Path, corpus: Path, tokenizer: Path, cache: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "plait", "train", "--nproc_per_node", "2", "--max_steps", "2",
            "--model_config", str(config), "--train_file", str(corpus), "--tokenizer_name", str(tokenizer),
            "--block_size", str(BLOCK), "--per_device_train_batch_size", str(BATCH), "--logging_steps", "1",
            "--data_cache_dir", str(cache), "--output_dir", str(out)]


def cache_meta(cache: Path) -> dict:
    (meta,) = list((cache / "tokens").glob("*/meta.json"))
    return json.loads(meta.read_text())


def old_path_worker(corpus: str, tokenizer: str) -> None:
    """One process of the replaced in-memory path: peak RSS over the RSS after imports, and seconds."""
    from plait.data.blocks import training_blocks

    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = vm_hwm(os.getpid())
    start = time.perf_counter()
    blocks, _ = training_blocks([Path(corpus)], BLOCK, VOCAB, tokenizer_dir=Path(tokenizer))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "over": vm_hwm(os.getpid()) - before, "peak": vm_hwm(os.getpid()),
                      "blocks": len(blocks)}))


def startup_worker(corpus: str, tokenizer: str, cache: str) -> None:
    """One process: seconds of the trainer's data start-up (``prepare_data``) with a warm cache."""
    from plait.run.train_args import TrainArgs
    from plait.run.train_data import prepare_data

    args = TrainArgs(train_file=corpus, tokenizer_name=tokenizer, data_cache_dir=cache, block_size=BLOCK)
    start = time.perf_counter()
    data = prepare_data(args, VOCAB, local_rank=0, progress=False)
    assert data.prepared == [], "the cache was not warm"
    print(json.dumps({"seconds": time.perf_counter() - start}))


def startup_seconds(corpus: Path, tokenizer: Path, cache: Path, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        result = subprocess.run([sys.executable, __file__, "--startup-worker", str(corpus), str(tokenizer), str(cache)],
                                capture_output=True, text=True, check=True, timeout=600)
        best = min(best, json.loads(result.stdout.strip().splitlines()[-1])["seconds"])
    return best


def tokenizer_alone(corpus: Path, tokenizer: Path, limit: int = 16 * MIB) -> float:
    """MB/s of the Rust tokenizer on in-memory text, batched as plait batches it (the ceiling here)."""
    from transformers import AutoTokenizer

    from plait.data.cache import BATCH_CHARS, TokenizerEncoder

    encoder = TokenizerEncoder(AutoTokenizer.from_pretrained(tokenizer))
    texts, size = [], 0
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= limit:
                break
    start, batch, chars = time.perf_counter(), [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            encoder.encode(batch)
            batch, chars = [], 0
    if batch:
        encoder.encode(batch)
    return size / 1e6 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,256", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--old-path-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--startup-worker", nargs=3, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.old_path_worker:
        old_path_worker(*ns.old_path_worker)
        return
    if ns.startup_worker:
        startup_worker(*ns.startup_worker)
        return
    sizes = sorted(int(s) for s in ns.sizes.split(","))
    work = Path(ns.keep) if ns.keep else Path(tempfile.mkdtemp(prefix="plait-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        bench(work, sizes)
    finally:
        if not ns.keep:
            shutil.rmtree(work, ignore_errors=True)


def bench(work: Path, sizes: list[int]) -> None:
    from plait.data import train_bpe_tokenizer
    from plait.data.tokenizer import BPE_SAMPLE_CHARS

    config = model_config(work / "config.json")
    corpora = {"tiny": work / "tiny.jsonl"}
    docs = {"tiny": make_corpus(corpora["tiny"], 64 * 1024, seed=0)}
    for size in sizes:
        corpora[size] = work / f"corpus-{size}mb.jsonl"
        docs[size] = make_corpus(corpora[size], size * 10**6, seed=size)
    start = time.perf_counter()
    tokenizer = work / "bpe32k"
    train_bpe_tokenizer([corpora[sizes[0]]], VOCAB).save_pretrained(tokenizer)
    bpe_seconds = time.perf_counter() - start
    print(f"corpora: JSON lines of Shakespeare passages; BPE (vocab {VOCAB}) trained on the {sizes[0]} MB corpus's "
          f"sample (<= {BPE_SAMPLE_CHARS / MIB:.0f} Mi characters) in {bpe_seconds:.1f} s")
    print(f"each run: plait train --nproc_per_node 2 --max_steps 2, Llama vocab {VOCAB} h=64 L=2, block {BLOCK}, "
          f"{os.cpu_count()} CPU cores")

    results = {}
    for name, corpus in corpora.items():
        cache = work / f"cache-{name}"
        cold_wall, cold_rss = run_monitored(train_command(config, corpus, tokenizer, cache, work / f"out-{name}-1"),
                                            work / f"log-{name}-1.txt")
        meta = cache_meta(cache)
        warm_wall, warm_rss = run_monitored(train_command(config, corpus, tokenizer, cache, work / f"out-{name}-2"),
                                            work / f"log-{name}-2.txt")
        results[name] = dict(meta=meta, cold_wall=cold_wall, cold_rss=cold_rss, warm_wall=warm_wall, warm_rss=warm_rss,
                             startup=startup_seconds(corpus, tokenizer, cache),
                             alone=tokenizer_alone(corpus, tokenizer) if name != "tiny" else None)

    base = results["tiny"]
    print()
    print(f"{'corpus':>8} {'docs':>9} {'tokens':>12} {'tokenize MB/s':>13} {'tokenizer alone':>15} "
          f"{'data start-up s':>15} {'over tiny s':>11} {'1st run s':>9} {'cached run s':>12} {'tiny run s':>10} "
          f"{'goals':>8}")
    for size in sizes:
        r = results[size]
        meta = r["meta"]
        mbps = meta["input_bytes"] / 1e6 / meta["seconds"]
        over = r["startup"] - base["startup"]
        goals = f"{'ok' if mbps >= GOAL_MBPS else 'MISS'}/{'ok' if over <= GOAL_STARTUP_S else 'MISS'}"
        print(f"{str(size) + ' MB':>8} {docs[size]:9,d} {meta['num_tokens']:12,d} {mbps:13.2f} {r['alone']:15.2f} "
              f"{r['startup']:15.2f} {over:11.2f} {r['cold_wall']:9.1f} {r['warm_wall']:12.1f} "
              f"{base['warm_wall']:10.1f} {goals:>8}")
    print(f"tiny corpus: data start-up {base['startup']:.2f} s (cached); runs' wall times include torchrun, imports, "
          f"gloo and 2 steps")
    print("goals: throughput >= 10 MB/s / cached data start-up <= 5 s over the tiny corpus's")

    print()
    print("peak RSS per rank (MiB), rank 0 / rank 1; over baseline = this run minus the tiny corpus's cached run")
    print(f"{'corpus':>8} {'1st run (rank 0 tokenizes)':>27} {'cached run':>15} {'tiny (baseline)':>15} "
          f"{'1st run over baseline':>22} {'cached over baseline':>21} {'goal':>5}")
    for size in sizes:
        r = results[size]

        def pair(rss: dict) -> str:
            return f"{rss.get(0, 0) / MIB:,.0f} / {rss.get(1, 0) / MIB:,.0f}"

        over_cold = max(r["cold_rss"].get(k, 0) - base["warm_rss"].get(k, 0) for k in (0, 1)) / MIB
        over_warm = max(r["warm_rss"].get(k, 0) - base["warm_rss"].get(k, 0) for k in (0, 1)) / MIB
        ok = "ok" if max(over_cold, over_warm) <= GOAL_RSS_MIB else "MISS"
        print(f"{str(size) + ' MB':>8} {pair(r['cold_rss']):>27} {pair(r['warm_rss']):>15} "
              f"{pair(base['warm_rss']):>15} {over_cold:22,.0f} {over_warm:21,.0f} {ok:>5}")

    old = [s for s in sizes if s <= 32]
    if old:
        print()
        print("the in-memory path this replaced (training_blocks: every rank tokenized the whole corpus), one process")
        print(f"{'corpus':>8} {'seconds':>8} {'MB/s':>6} {'peak RSS MiB':>12} {'over its imports MiB':>20} "
              f"{'x the corpus':>12}")
        for size in old:
            result = subprocess.run([sys.executable, __file__, "--old-path-worker", str(corpora[size]), str(tokenizer)],
                                    capture_output=True, text=True, check=True, timeout=3600)
            r = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{str(size) + ' MB':>8} {r['seconds']:8.1f} {size / r['seconds']:6.2f} {r['peak'] / MIB:12,.0f} "
                  f"{r['over'] / MIB:20,.0f} {r['over'] / (size * 1e6):12.1f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    main()
