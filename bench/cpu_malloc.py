"""What glibc's returning of freed memory costs a CPU training step (``plait.base.host_memory``), side by side in one run:

    python bench/cpu_malloc.py [--rounds 2] [--steps 5]

One thread (as each of torchrun's local processes), plait's training step (forward with the loss, backward of each
micro-batch, AdamW, clipping) of two models: the calibration run's Llama (``costs.calibration.run_config``) and
bench/plan_check.py's GPT-2, on 8 and 16 sequences of 128 tokens, each as one micro-batch and as two. Each model and
setting runs in a process of its own ("default": glibc as it starts; "kept": ``keep_freed_memory()`` first), the
settings alternating over the rounds so the VM's drift hits both; the table is the median step, in CPU time, over
the rounds' timed steps. The split columns say whether one micro-batch or two ran faster: a step-time model of
FLOPs, bytes and a per-micro-batch overhead has one micro-batch never slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [(8, 1), (8, 2), (16, 1), (16, 2)]  # (sequences of 128 tokens, micro-batches)


def model_config(name: str):
    if name == "llama":
        from plait.costs.calibration import run_config

        return run_config()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_check import time_models

    return time_models(False)["gpt2"][0]


def child(name: str, kept: bool, steps: int) -> dict[str, list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from plait import ParallelConfig, parallelize
    from plait.base.host_memory import keep_freed_memory
    from plait.optim import OptimizerStep, build_optimizer

    if kept:
        assert keep_freed_memory(), "not glibc: nothing to compare"
    torch.set_num_threads(1)
    config = model_config(name)
    torch.manual_seed(0)
    pmodel = parallelize(AutoModelForCausalLM.from_config(config), ParallelConfig())
    step = OptimizerStep(pmodel.grad_sync, build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4), 1.0)
    ids = torch.randint(0, config.vocab_size, (16, 128))
    times: dict[str, list[float]] = {f"{b}x{m}": [] for b, m in CASES}
    for turn in range(steps + 2):  # 2 warm-up turns
        for b, m in CASES:
            chunks = ids[:b].chunk(m)
            items = sum(c.numel() - c.shape[0] for c in chunks)
            start = time.thread_time()
            for chunk in chunks:
                loss = pmodel.train_step(chunk, chunk, num_items_in_batch=items)
            step(loss)
            if turn >= 2:
                times[f"{b}x{m}"].append(time.thread_time() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(child(ns.child[0], ns.child[1] == "kept", ns.steps)))
        return
    seconds: dict[tuple[str, str, str], list[float]] = {}
    for round_ in range(ns.rounds):
        for name in ("llama", "gpt2"):
            settings = ("default", "kept") if round_ % 2 == 0 else ("kept", "default")
            for setting in settings:
                out = subprocess.run([sys.executable, __file__, "--steps", str(ns.steps), "--child", name, setting],
                                     capture_output=True, text=True, check=True)
                for case, values in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    seconds.setdefault((name, case, setting), []).extend(values)
    print("| model | sequences x 128 tokens, micro-batches | default (s) | kept (s) | kept / default |")
    print("| --- | --- | ---: | ---: | ---: |")
    median = {key: statistics.median(values) for key, values in seconds.items()}
    for name in ("llama", "gpt2"):
        for b, m in CASES:
            default, kept = median[name, f"{b}x{m}", "default"], median[name, f"{b}x{m}", "kept"]
            print(f"| {name} | {b} x {m} | {default:.4f} | {kept:.4f} | {kept / default:.2f} |")
    print("\nTwo micro-batches over one (the same tokens): below 1, the split ran faster")
    for name in ("llama", "gpt2"):
        for b in sorted({b for b, _ in CASES}):
            ratios = [median[name, f"{b}x2", s] / median[name, f"{b}x1", s] for s in ("default", "kept")]
            print(f"- {name}, {b} sequences: default {ratios[0]:.3f}, kept {ratios[1]:.3f}")


if __name__ == "__main__":
    main()
