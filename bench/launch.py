"""What a preloaded fork server saves: the same worlds started as fresh processes and forked from the server
(plait.base.forking), side by side, alternating rounds.

    python bench/launch.py [--rounds 3] [--suite]

A world here is 2 ranks that import transformers, build a tiny Llama, join a gloo world and take one tp=2 training
step: the shape of most test worlds (plait.testing.launcher). The second table is a whole ``plait train
--nproc_per_node 2`` command (tiny Llama, 2 steps, a checkpoint) started the three ways plait.run.torchrun knows:
torchrun forked from the command and forking the workers (a command of its own on a machine without an accelerator),
a fresh torchrun forking them from its fork server (plait.cli.main called in a process with threads), and fresh
``python -m plait`` workers (an accelerator present): wall time and the CPU-seconds the machine spent (/proc/stat, so
nothing else may run). ``--suite`` also times the whole test suite once per way
(``PLAIT_LAUNCH``), which takes most of half an hour. Run it on an idle machine: the ranks compete for the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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


# plait train as its command line runs it, with the workers' start chosen (plait.run.torchrun asks forking_is_safe
# and ForkedTorchrun.possible)
COMMAND = """
import sys
import plait.base.forking as forking
from plait.run.torchrun import ForkedTorchrun
way = sys.argv.pop(1)
forking.forking_is_safe = lambda: way != "fresh"
if way == "fork server":
    ForkedTorchrun.possible = staticmethod(lambda: False)
from plait.cli import main
main()
"""


def cpu_seconds() -> float:
    """CPU time the machine has spent, all processes (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def time_command(way: str, tmp: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one ``plait train --nproc_per_node 2`` with its workers started ``way``."""
    out = tmp / f"out-{way.replace(' ', '-')}-{time.monotonic_ns()}"
    cpu, start = cpu_seconds(), time.monotonic()
    subprocess.run([sys.executable, "-c", COMMAND, way, "train", "--model_config", str(tmp / "config.json"),
                    "--nproc_per_node", "2", "--output_dir", str(out), "--max_steps", "2", "--block_size", "16"],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.monotonic() - start, cpu_seconds() - cpu


def compare_commands(rounds: int, tmp: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).to_json_file(tmp / "config.json")
    runs: dict[str, list[tuple[float, float]]] = {"forked torchrun": [], "fork server": [], "fresh": []}
    for _ in range(rounds):
        for way in runs:
            runs[way].append(time_command(way, tmp))
    print("\n| plait train --nproc_per_node 2, workers | wall, median s | CPU, median s | rounds (wall / CPU) |")
    print("| --- | ---: | ---: | --- |")
    for way, values in runs.items():
        wall, cpu = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        print(f"| {way} | {wall:.1f} | {cpu:.1f} | {', '.join(f'{w:.1f} / {c:.1f}' for w, c in values)} |")


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
    with tempfile.TemporaryDirectory() as tmp:
        compare_commands(args.rounds, Path(tmp))
    if args.suite:
        print("\n| ranks started as | whole suite, s | result |")
        print("| --- | ---: | --- |")
        for mode in ("subprocess", "fork"):
            os.environ[LAUNCH_ENV] = mode  # tests/conftest.py keeps a value it is given
            seconds, result = time_suite(sys.executable, ROOT, [])
            print(f"| {mode} | {seconds:.0f} | {result} |")


if __name__ == "__main__":
    main()
