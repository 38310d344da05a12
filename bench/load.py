"""Peak memory of loading a ~1.2 GiB Llama at tp=2, and consolidation speed beside a plain copy.

    python bench/load.py [--keep DIR]

1. Writes a Llama with random fp32 weights (safetensors, one file) to a temporary directory.
2. World of 2, ``plait.checkpoint.materialize.load_parallel_model(dir, tp=2)``: each rank's peak RSS over its baseline
   (after imports, before loading; peak from VmHWM, reset through /proc/self/clear_refs) beside the bytes of
   its shards. Goal: at most 1.25x the shard bytes.
3. Same world, naive: ``parallelize(AutoModelForCausalLM.from_pretrained(dir), tp=2)`` on every rank (the
   whole model, then sharded), and ``safetensors.torch.load_file`` of the whole file (every tensor read).
4. The tp=2 model is saved as a plait checkpoint; rank 0 times ``consolidate`` (and its peak RSS) beside
   ``shutil.copyfile`` of the same shard files, alternating, three times each. Goal: at least half the copy
   speed.
Everything written is deleted at the end (check ``df -h /tmp`` first: about 5 GB are needed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)


def rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak() -> int:
    """Reset the peak-RSS counter to the current RSS (Linux >= 4.0) and return that baseline."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss()


def peak() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def write_model(directory: Path) -> int:
    import torch
    from safetensors.torch import save_file

    from plait.base.meta import build_meta_model

    config = model_config()
    meta = build_meta_model(config)
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(p.shape, generator=gen) * 0.02 for name, p in meta.state_dict().items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)
    return (directory / "model.safetensors").stat().st_size


def worker(mode: str, source: Path, work: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the baseline)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from plait import ParallelConfig, parallelize
    from plait.checkpoint import consolidate, save_checkpoint
    from plait.checkpoint.materialize import load_parallel_model

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    dist.barrier()
    if mode == "plait":
        base = reset_peak()
        start = time.perf_counter()
        pmodel = load_parallel_model(source, ParallelConfig(tp=2))
        result["seconds"] = time.perf_counter() - start
        result["peak"] = peak() - base
        result["shard_bytes"] = sum(p.numel() * p.element_size() for p in pmodel.parameters())
        ckpt = save_checkpoint(work / "checkpoint-0", pmodel)
        dist.barrier()
        if rank == 0:
            shards = sorted((ckpt / "shards").glob("model-*.safetensors"))
            result["checkpoint_bytes"] = sum(p.stat().st_size for p in shards)
            copies, consolidations, peaks = [], [], []
            for attempt in range(3):
                target = work / f"copy{attempt}"
                target.mkdir()
                os.sync()
                start = time.perf_counter()
                for path in shards:
                    shutil.copyfile(path, target / path.name)
                os.sync()
                copies.append(time.perf_counter() - start)
                shutil.rmtree(target)
                os.sync()
                base = reset_peak()
                start = time.perf_counter()
                consolidate(ckpt, work / f"hf{attempt}")
                os.sync()
                consolidations.append(time.perf_counter() - start)
                peaks.append(peak() - base)
                shutil.rmtree(work / f"hf{attempt}")
            result.update(copy_seconds=copies, consolidate_seconds=consolidations, consolidate_peak=max(peaks),
                          largest_tensor=max(math.prod(s.full_shape) * 4 for s in pmodel.param_specs.values()))
    elif mode == "from_pretrained":  # the whole model on every rank, then sharded
        base = reset_peak()
        start = time.perf_counter()
        pmodel = parallelize(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), ParallelConfig(tp=2))
        result["seconds"] = time.perf_counter() - start
        result["peak"] = peak() - base
        del pmodel
    elif mode == "load_file":  # the whole file's tensors, each read once (mmap pages count once touched)
        base = reset_peak()
        start = time.perf_counter()
        state = load_file(source / "model.safetensors")
        sum(float(t.sum()) for t in state.values())
        result["seconds"] = time.perf_counter() - start
        result["peak"] = peak() - base
        del state
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "SOURCE", "WORK", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="parent of the temporary directory (default: system temp)")
    args = parser.parse_args()
    if args.worker:
        mode, source, work, out = args.worker
        worker(mode, Path(source), Path(work), Path(out))
        return

    from plait.testing import launch

    tmp = Path(tempfile.mkdtemp(prefix="plait-bench-load-", dir=args.dir))
    try:
        source = tmp / "model"
        source.mkdir()
        start = time.perf_counter()
        model_bytes = write_model(source)
        seconds = time.perf_counter() - start
        print(f"wrote {model_bytes / MIB:.0f} MiB of fp32 Llama weights in {seconds:.1f}s ({source})")
        runs = {}
        for mode in ("plait", "from_pretrained", "load_file"):
            out = tmp / f"{mode}.json"
            launch([__file__, "--worker", mode, str(source), str(tmp), str(out)], 2, timeout=900)
            runs[mode] = json.loads(out.read_text())
        print()
        print(f"Load at tp=2 (world of 2), model file {model_bytes / MIB:.0f} MiB; peak RSS over baseline per rank")
        print(f"{'rank':>4} | {'shard MiB':>9} | {'plait lazy':>16} | {'from_pretrained':>16} | {'load_file':>16}")
        for rank in range(2):
            plait, fp, lf = (runs[m][rank] for m in ("plait", "from_pretrained", "load_file"))
            shard = plait["shard_bytes"]

            def cell(r):
                return f"{r['peak'] / MIB:6.0f} MiB {r['peak'] / shard:4.2f}x"

            print(f"{rank:>4} | {shard / MIB:9.0f} | {cell(plait):>16} | {cell(fp):>16} | {cell(lf):>16}")
        print(f"load seconds (rank 0): plait {runs['plait'][0]['seconds']:.2f}, from_pretrained "
              f"{runs['from_pretrained'][0]['seconds']:.2f}, load_file {runs['load_file'][0]['seconds']:.2f}")
        r0 = runs["plait"][0]
        size = r0["checkpoint_bytes"]
        print()
        print(f"Consolidation of the tp=2 checkpoint ({size / MIB:.0f} MiB of shard files), rank 0, alternating runs "
              f"(each followed by os.sync)")
        print(f"{'':>24} | {'run 1':>7} | {'run 2':>7} | {'run 3':>7} | {'best MiB/s':>10}")
        for label, key in (("shutil.copyfile shards", "copy_seconds"), ("plait consolidate", "consolidate_seconds")):
            t = r0[key]
            print(f"{label:>24} | " + " | ".join(f"{x:6.2f}s" for x in t) + f" | {size / MIB / min(t):10.0f}")
        best = min(r0["copy_seconds"]) / min(r0["consolidate_seconds"])
        median = sorted(r0["copy_seconds"])[1] / sorted(r0["consolidate_seconds"])[1]
        print(f"consolidate speed / copy speed: best runs {best:.2f}, median runs {median:.2f}  (goal >= 0.5)")
        print(f"consolidate peak RSS over baseline: {r0['consolidate_peak'] / MIB:.0f} MiB "
              f"(bound: 2 x largest tensor {r0['largest_tensor'] / MIB:.0f} MiB + 200 MiB)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
