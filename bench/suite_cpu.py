"""Where a test world's CPU goes on this machine: gloo's collectives, a tiny model's tp=2 step, the float64 mode.

    python bench/suite_cpu.py [--ops 2000] [--steps 20]

The suite's CPU is mostly its launched worlds training tiny models, and a tiny model's step costs what its
collectives and Python cost, not what its arithmetic does. Three tables, each per rank and from the kernel's own
accounting (getrusage: every thread of the process, user and system time apart, context switches):

1. one gloo collective between two ranks, of the sizes a tiny model's step sends: CPU microseconds per op (user,
   system), context switches per op and wall microseconds;
2. one training step of the conformance kit's tiny qwen3 (the generic adapter's tiny config: 4 layers, hidden 32,
   a batch of 2 x 16 tokens) at tp=2 with SP, against a plain forward and backward of the same model in one
   process, with the collectives one step issues;
3. the same one-process forward and backward in float64, plain and under the conformance kit's float64 mode
   (``conformance_worker.Float64Throughout``, which the kit's rechecks and the float64 worlds run under).

Run it alone (a concurrent job shares the two cores) and on each machine kind whose suite times differ: the same
figures side by side say which part of the work costs more there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ARCH, BATCH, SEQ = "transformers:qwen3", 2, 16


def usage() -> tuple[float, float, int, float]:
    """(user s, system s, context switches, wall s) of this process so far: every thread of it."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime, ru.ru_nvcsw + ru.ru_nivcsw, time.perf_counter()


def per_call(fn: Callable[[], object], calls: int, warmup: int = 20) -> dict[str, float]:
    """``fn``'s cost per call after ``warmup`` calls: user and system microseconds, switches, wall microseconds."""
    for _ in range(warmup):
        fn()
    before = usage()
    for _ in range(calls):
        fn()
    after = usage()
    user, system, switches, wall = (b - a for a, b in zip(before, after))
    return {"user_us": user / calls * 1e6, "sys_us": system / calls * 1e6, "switches": switches / calls,
            "wall_us": wall / calls * 1e6}


def tiny_model():
    import torch
    from transformers import AutoModelForCausalLM

    from plait.testing.conformance_modes import load_subject

    subject = load_subject(ARCH)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(subject.config)
    ids = torch.randint(0, subject.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return subject, model, ids


def worker(out: Path, ops: int, steps: int) -> None:
    """A rank: the collectives of table 1, then table 2's parallel step; rank 0 writes what it measured."""
    import torch
    import torch.distributed as dist

    from plait import ParallelConfig, parallelize
    from plait.base.comm import count_collectives

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    small, act = torch.randn(64), torch.randn(BATCH, SEQ // world, 32)
    gathered, full = torch.empty(BATCH * world, SEQ // world, 32), torch.randn(BATCH * world, SEQ // world, 32)
    table = {
        "all_reduce 64 floats": per_call(lambda: dist.all_reduce(small), ops),
        "all_gather 2x8x32": per_call(lambda: dist.all_gather_into_tensor(gathered, act), ops),
        "reduce_scatter 4x8x32": per_call(lambda: dist.reduce_scatter_tensor(act, full), ops),
        "broadcast 64 floats": per_call(lambda: dist.broadcast(small, src=0), ops),
    }
    subject, model, ids = tiny_model()
    pmodel = parallelize(model, ParallelConfig(tp=world, sp=True), registry=subject.registry)
    with count_collectives() as counter:
        pmodel.train_step(ids, ids, None, ids.numel())
    step = per_call(lambda: pmodel.train_step(ids, ids, None, ids.numel()), steps, warmup=2)
    if dist.get_rank() == 0:
        (out / "rank0.json").write_text(json.dumps({"collectives": table, "step": step,
                                                    "step_collectives": counter.count()}))
    dist.destroy_process_group()


def one_process(steps: int) -> dict[str, dict[str, float]]:
    """Table 2's plain step and table 3's float64 steps, in this process on one thread (as a rank runs)."""
    import torch

    from plait.testing.conformance_worker import Float64Throughout

    torch.set_num_threads(1)
    _, model, ids = tiny_model()

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    found = {"fp32": per_call(step, steps, warmup=3)}
    model.double()
    found["float64"] = per_call(step, steps, warmup=3)
    with Float64Throughout():
        found["float64 mode"] = per_call(step, steps, warmup=3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="calls of each collective timed")
    parser.add_argument("--steps", type=int, default=20, help="training steps timed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(Path(ns.worker), ns.ops, ns.steps)
        return
    from plait.testing import launch

    out = Path(tempfile.mkdtemp(prefix="suite_cpu-"))
    launch([__file__, "--worker", str(out), "--ops", str(ns.ops), "--steps", str(ns.steps)], 2, timeout=900)
    ranks = json.loads((out / "rank0.json").read_text())
    single = one_process(ns.steps)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    print(f"{model}, {os.cpu_count()} CPUs; gloo, 2 ranks; per rank, every thread (getrusage)\n")
    print("| collective | user us | system us | switches | wall us |\n| --- | --- | --- | --- | --- |")
    for name, row in ranks["collectives"].items():
        print(f"| {name} | {row['user_us']:.0f} | {row['sys_us']:.0f} | {row['switches']:.1f} | {row['wall_us']:.0f} |")
    step, plain = ranks["step"], single["fp32"]
    print(f"\n| tiny qwen3 step ({BATCH} x {SEQ} tokens) | user ms | system ms | switches | collectives |\n"
          f"| --- | --- | --- | --- | --- |")
    print(f"| one process, forward + backward | {plain['user_us'] / 1e3:.1f} | {plain['sys_us'] / 1e3:.1f} | "
          f"{plain['switches']:.0f} | 0 |")
    print(f"| tp=2 + SP train_step, one rank | {step['user_us'] / 1e3:.1f} | {step['sys_us'] / 1e3:.1f} | "
          f"{step['switches']:.0f} | {ranks['step_collectives']} |")
    print("\n| one process, forward + backward | CPU ms | vs plain float64 |\n| --- | --- | --- |")
    base = single["float64"]["user_us"] + single["float64"]["sys_us"]
    for name in ("fp32", "float64", "float64 mode"):
        cpu = single[name]["user_us"] + single[name]["sys_us"]
        print(f"| {name} | {cpu / 1e3:.1f} | {cpu / base:.2f}x |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    main()
