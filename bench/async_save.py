"""What a checkpoint every 2 steps costs a run: without saves, with synchronous saves, with --save_async.

    python bench/async_save.py [--rounds 3] [--steps 12] [--threads 1]

Each run is ``plait train``'s Trainer in a process of its own (one rank, fp32 AdamW, a Llama of about 30M
parameters: a checkpoint of its weights and AdamW state is about 0.35 GB), built before the clock starts; the
clock covers ``Trainer.train()``: every step, every save and, for --save_async, the wait for the last one. The
three kinds run in turns (round-robin), so a slow spell of the machine hits each; the table gives each kind's
median and its ratio to the run without saves. Run it alone on the machine. ``--threads`` is torch's threads for
the training (the background write takes a thread of its own on top: on the 2-core VM 1 leaves it a core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=256)
KINDS = ("no saves", "synchronous", "--save_async")


def run_dir(tmp: Path, kind: str) -> Path:
    return tmp / kind.strip("-")


def worker(kind: str, steps: int, tmp: Path) -> None:
    """One run: print the seconds ``train()`` took and the checkpoints it left."""
    from plait.run.train_args import TrainArgs
    from plait.run.trainer import Trainer

    saves = {} if kind == "no saves" else {"save_steps": 2, "save_async": kind == "--save_async"}
    trainer = Trainer(TrainArgs(model_config=str(tmp / "config.json"), output_dir=str(run_dir(tmp, kind)),
                                max_steps=steps, per_device_train_batch_size=4, block_size=128, save_final=False,
                                lr_scheduler_type="constant", **saves))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    saved = sorted(p.name for p in run_dir(tmp, kind).glob("checkpoint-*"))
    print(json.dumps({"seconds": seconds, "saved": saved}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        kind, steps, tmp = ns.worker
        worker(KINDS[int(kind)], int(steps), Path(tmp))
        return
    from transformers import LlamaConfig

    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="async-save-") as tmp:
        (Path(tmp) / "config.json").write_text(LlamaConfig(**MODEL).to_json_string())
        env = {**os.environ, "OMP_NUM_THREADS": str(ns.threads)}
        for _ in range(ns.rounds):
            for kind in KINDS:
                done = subprocess.run([sys.executable, __file__, "--worker", str(KINDS.index(kind)), str(ns.steps), tmp], env=env,
                                      capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                expected = [] if kind == "no saves" else [f"checkpoint-{s}" for s in range(2, ns.steps + 1, 2)]
                assert sorted(result["saved"]) == sorted(expected), (kind, result["saved"])
                seconds[kind].append(result["seconds"])
                shutil.rmtree(run_dir(Path(tmp), kind))  # the next run starts without checkpoints
    base = statistics.median(seconds["no saves"])
    print(f"plait train, one rank, Llama h={MODEL['hidden_size']} L={MODEL['num_hidden_layers']} "
          f"vocab={MODEL['vocab_size']}, 4 x 128 tokens a step, {ns.steps} steps, a checkpoint every 2 steps, "
          f"torch threads {ns.threads}, {ns.rounds} rounds in turns")
    print(f"| {'run':<13} | {'seconds per round':<30} | {'median s':>8} | {'vs no saves':>11} |")
    print(f"| {'-' * 13} | {'-' * 30} | {'-' * 8} | {'-' * 11} |")
    for kind in KINDS:
        median = statistics.median(seconds[kind])
        rounds = " ".join(f"{s:.2f}" for s in seconds[kind])
        print(f"| {kind:<13} | {rounds:<30} | {median:8.2f} | {median / base:10.3f}x |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    main()
