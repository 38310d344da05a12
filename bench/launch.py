"""What the test launcher's fork server saves: the same worlds started as fresh processes and forked from the
preloaded server (plait.testing.launcher), side by side, alternating rounds.

    python bench/launch.py [--rounds 3] [--suite]

A world here is 2 ranks that import transformers, build a tiny Llama, join a gloo world and take one tp=2 training
step: the shape of most test worlds. ``--suite`` also times the whole test suite once per way (``PLAIT_LAUNCH``),
which takes most of half an hour. Run it on an idle machine: the ranks compete for the same 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from plait.testing.launcher import LAUNCH_ENV, launch
from suite_time import time_suite  # bench/, beside this script

ROOT = Path(__file__).resolve().parent.parent
WORKER = """
import torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
import plait
dist.init_process_group("gloo")
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
model = plait.parallelize(LlamaForCausalLM(config), plait.ParallelConfig(tp=2))
ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
model.train_step(ids, ids).item()
dist.destroy_process_group()
"""


def time_world(mode: str, script: Path) -> float:
    os.environ[LAUNCH_ENV] = mode
    start = time.monotonic()
    launch([str(script)], 2, timeout=300)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--suite", action="store_true", help="also time the whole test suite each way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "world.py"
        script.write_text(WORKER)
        time_world("fork", script)  # starts the server (its imports are paid once per test run)
        times: dict[str, list[float]] = {"subprocess": [], "fork": []}
        for _ in range(args.rounds):
            for mode in times:
                times[mode].append(time_world(mode, script))
    print("| ranks started as | world of 2, median s | rounds |")
    print("| --- | ---: | --- |")
    for mode, values in times.items():
        print(f"| {mode} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    print(f"\nfork / subprocess: {statistics.median(times['fork']) / statistics.median(times['subprocess']):.2f}")
    if args.suite:
        print("\n| ranks started as | whole suite, s | result |")
        print("| --- | ---: | --- |")
        for mode in ("subprocess", "fork"):
            os.environ[LAUNCH_ENV] = mode  # tests/conftest.py keeps a value it is given
            seconds, result = time_suite(sys.executable, ROOT, [])
            print(f"| {mode} | {seconds:.0f} | {result} |")


if __name__ == "__main__":
    main()
