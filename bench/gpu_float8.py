"""float8 against bf16 on one GPU: ``plait train --bf16 --torch_compile`` on a 3B-shaped Llama (Llama-3.2-3B's
dimensions) with and without ``--float8 tensorwise`` / ``rowwise``: tokens/s and the loss curve. Run by hand on a
GPU of compute capability 8.9+ (CI has none):

    python bench/gpu_float8.py [--steps 200] [--batch 4] [--block 2048]
    python bench/gpu_float8.py --tiny                 # the plumbing, on the CPU with --float8_emulate

Each variant is a ``plait train`` process on the bundled corpus (the same tokens in the same order for all), with
metrics.jsonl read afterwards. tokens/s is the median over the steps after the first 10 (warm-up and compilation);
the loss curves are compared after a 10-step moving average (a step's loss is one batch's and noisy), as the
largest relative difference from bf16's over the second half of the run, where the goal is 1%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plait.run.metrics import read_metrics

LLAMA_3B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16384, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
TINY = {**LLAMA_3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
VARIANTS = {"bf16": [], "float8-tensorwise": ["--float8", "tensorwise"], "float8-rowwise": ["--float8", "rowwise"]}


def smoothed(values: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def train(name: str, config: Path, args: argparse.Namespace, out: Path) -> dict:
    flags = ["--model_config", str(config), "--bf16", "--per_device_train_batch_size", str(args.batch),
             "--block_size", str(args.block), "--max_steps", str(args.steps), "--learning_rate", "3e-4",
             "--warmup_steps", str(max(1, args.steps // 10)), "--output_dir", str(out / name), "--seed", "0",
             "--data_cache_dir", str(out / "cache"), "--no_save_final"]  # speed and loss only: no checkpoint to write
    if args.tiny:
        flags += ["--device", "cpu"] + (["--float8_emulate"] if VARIANTS[name] else [])
    else:
        flags += ["--torch_compile"]
    flags += ["--gradient_checkpointing"] if args.checkpointing else []
    run = subprocess.run([sys.executable, "-m", "plait", "train", *flags, *VARIANTS[name]], capture_output=True,
                         text=True)
    if run.returncode != 0:
        return {"variant": name, "error": (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]}
    records = [r for r in read_metrics(out / name) if "loss" in r]
    timed = [r["tokens_per_s"] for r in records[10:]] or [r["tokens_per_s"] for r in records]
    return {"variant": name, "tokens_per_s": statistics.median(timed), "losses": [r["loss"] for r in records],
            "peak_gpu_gib": max((r.get("peak_device_mb") or 0) for r in records) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="without activation checkpointing (more memory)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU, emulated float8")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.batch, args.block = min(args.steps, 24), 2, 64
    with tempfile.TemporaryDirectory(prefix="plait-float8-") as tmp:
        out = Path(tmp)
        config = out / "config.json"
        config.write_text(json.dumps(TINY if args.tiny else LLAMA_3B))
        rows = []
        for name in VARIANTS:
            rows.append(train(name, config, args, out))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    base = rows[0]
    print(f"\n{args.steps} steps, batch {args.batch} x {args.block}, --bf16 (fp32 masters)"
          f"{' --torch_compile' if not args.tiny else ''}{' --gradient_checkpointing' if args.checkpointing else ''}")
    print("| variant | tokens/s | vs bf16 | final loss (10-step mean) | max loss diff vs bf16, 2nd half |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r or "error" in base:
            print(f"| {r['variant']} | error: {r.get('error', base.get('error', ''))[:90]} | | | |")
            continue
        mine, ref = smoothed(r["losses"]), smoothed(base["losses"])
        half = len(ref) // 2
        diff = max(abs(a - b) / b for a, b in zip(mine[half:], ref[half:]))
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f} | "
              f"{mine[-1]:.4f} | {diff:.2%} |")


if __name__ == "__main__":
    main()
