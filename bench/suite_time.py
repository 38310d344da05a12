"""How long does the test suite take, and where does the time go? Or: is it slower than at an earlier commit?

    python bench/suite_time.py [--top 20] [pytest args ...]     the whole suite (or the given files), as CI runs
                                                                  it: total wall time, the slowest items, per file
    python bench/suite_time.py --base 0921804 [--rounds 2] [--same-env] [--files tests/test_pipeline.py ...]   A/B

The first form runs pytest once with a JUnit report and prints the wall-clock total, then the ``--top`` slowest
items (a test's time includes its share of fixture set-up: a module's launched world is charged to the first test
that asks for it) and the files by their summed time. Run it alone on the machine: the suite's worlds compete
for the same cores, and a concurrent job stretches every figure (2 cores: a second suite doubles them).

The second form times the same test files at HEAD and at an earlier commit side by side. The earlier commit runs
from a git worktree in its own virtual environment, built by that commit's own scripts/setup.sh and then given
every third-party package of this environment at the same version: an installed package changes start-up time
(transformers imports scipy, accelerate, boto3... whenever they are installed: about 2 s per worker process here),
so both sides must see the same ones. ``--same-env`` skips that venv (where this environment's packages do not all
install into it again: on 2026-11-30 pip exited 1 on this environment's list): each side runs in this environment
with its own tree's sources first on PYTHONPATH (core and every adapter), which serves a change to plait or its
tests, not to its dependencies. Rounds alternate (head, base, head, base, ...) so that drift in the machine's load
hits both. Beside the wall time, the machine's CPU-seconds over the run (Linux's /proc/stat: every process, so
nothing else may run).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_tp_parity.py", "tests/test_pipeline.py", "tests/test_optim.py", "tests/test_train_cli.py",
         "tests/test_checkpoint_dist.py", "tests/test_conformance.py"]


def run(cmd: list[str], **kwargs) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs).stdout


def profile(pytest_args: list[str], top: int) -> int:
    """Run pytest once (``pytest_args``, default the whole suite) and print the total, the slowest items and the
    files by their summed time; returns pytest's exit status."""
    with tempfile.TemporaryDirectory(prefix="plait-suite-time-") as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               *pytest_args], cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - start
        cases = [(f"{c.get('classname', '').replace('.', '/')}.py::{c.get('name')}", float(c.get("time", 0)))
                 for c in ET.parse(report).iter("testcase")] if report.exists() else []
    summary = next((line for line in reversed(done.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                   "no summary")
    print(f"suite: {wall:.0f} s wall ({wall / 60:.1f} min), {len(cases)} items: {summary.strip('= ')}")
    print(f"\n| the {top} slowest items | seconds |\n| --- | --- |")
    for name, seconds in sorted(cases, key=lambda c: -c[1])[:top]:
        print(f"| {name} | {seconds:.1f} |")
    by_file: dict[str, float] = defaultdict(float)
    for name, seconds in cases:
        by_file[name.split("::")[0]] += seconds
    print("\n| file | seconds | share |\n| --- | --- | --- |")
    total = sum(by_file.values()) or 1.0
    for name, seconds in sorted(by_file.items(), key=lambda f: -f[1])[:top]:
        print(f"| {name} | {seconds:.0f} | {seconds / total:.0%} |")
    if done.returncode not in (0, 5):
        print(done.stdout[-3000:], file=sys.stderr)
    return done.returncode


def base_env(commit: str, work: Path) -> tuple[Path, Path]:
    """A worktree of ``commit`` and a venv with its plait installed plus this environment's packages."""
    tree, venv = work / "tree", work / "venv"
    run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit])
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    ours = [line for line in run([sys.executable, "-m", "pip", "freeze"]).splitlines()
            if line and not line.startswith(("-e", "plait")) and "@ file:" not in line]
    (work / "requirements.txt").write_text("\n".join(ours) + "\n")
    run(["bash", "scripts/setup.sh"], cwd=tree, env={**os.environ, "PYTHON": str(python), "PLAIT_EXTRAS": "test,plot"})
    run([str(python), "-m", "pip", "install", "-q", "-r", str(work / "requirements.txt")])
    return tree, python


def sources_first(tree: Path) -> dict[str, str]:
    """``--same-env``: ``tree``'s plait and adapters imported before the installed (editable) ones."""
    paths = [tree / "core", *sorted(p for p in (tree / "adapters").iterdir() if (p / "pyproject.toml").exists())]
    return {"PYTHONPATH": os.pathsep.join(map(str, paths))}


def busy_seconds() -> float | None:
    """The machine's CPU-seconds so far (user, nice, system, irq, softirq), or None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except OSError:
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def time_suite(python: str, tree: Path, files: list[str], extra_env: dict[str, str]) -> tuple[float, float | None, str]:
    env = {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}", **extra_env}
    start, busy = time.monotonic(), busy_seconds()
    done = subprocess.run([python, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"], cwd=tree,
                          capture_output=True, text=True, env=env)
    cpu = None if busy is None else busy_seconds() - busy
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return time.monotonic() - start, cpu, re.sub(r" in [\d.]+s.*", "", summary)


def compare(base: str, rounds: int, files: list[str], same_env: bool) -> int:
    """The A/B form: ``files`` at HEAD and at ``base``, alternating, ``rounds`` times each."""
    head = run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip()
    with tempfile.TemporaryDirectory(prefix="plait-suite-time-") as tmp:
        if same_env:
            tree, python = Path(tmp) / "tree", sys.executable
            run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base])
        else:
            tree, python = base_env(base, Path(tmp))
        try:
            rows = []
            for _ in range(rounds):
                rows.append((f"HEAD {head}", *time_suite(sys.executable, ROOT, files,
                                                         sources_first(ROOT) if same_env else {})))
                rows.append((f"base {base}", *time_suite(str(python), tree, files,
                                                         sources_first(tree) if same_env else {})))
        finally:
            run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    print("| commit | seconds | CPU-seconds | tests |\n| --- | --- | --- | --- |")
    for name, seconds, cpu, summary in rows:
        print(f"| {name} | {seconds:.0f} | {'-' if cpu is None else f'{cpu:.0f}'} | {summary} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest items and files to list")
    parser.add_argument("--base", help="an earlier commit to time the --files against, side by side")
    parser.add_argument("--rounds", type=int, default=1, help="with --base: alternating rounds")
    parser.add_argument("--files", nargs="+", default=FILES, help="with --base: the test files to time")
    parser.add_argument("--same-env", action="store_true",
                        help="with --base: both sides in this environment, each tree's sources first on PYTHONPATH")
    args, pytest_args = parser.parse_known_args()
    if args.base:
        return compare(args.base, args.rounds, args.files, args.same_env)
    return profile(pytest_args, args.top)


if __name__ == "__main__":
    sys.exit(main())
