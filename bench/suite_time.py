"""Is the test suite slower than at an earlier commit? Time the same test files at both, side by side.

    python bench/suite_time.py --base 0921804 [--rounds 2] [--files tests/test_pipeline.py ...]

The earlier commit runs from a git worktree in its own virtual environment, built by that commit's own
scripts/setup.sh and then given every third-party package of this environment at the same version: an
installed package changes start-up time (transformers imports scipy, accelerate, boto3... whenever they are
installed: about 2 s per worker process here), so both sides must see the same ones. A separate environment
is needed because this one's plait entry points (plait-transformers) do not import into an older core.
Rounds alternate (head, base, head, base, ...) so that drift in the machine's load hits both. Run it on an
idle machine: every test world is a set of processes competing for the same cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_tp_parity.py", "tests/test_pipeline.py", "tests/test_optim.py", "tests/test_train_cli.py",
         "tests/test_checkpoint_dist.py", "tests/test_conformance.py"]


def run(cmd: list[str], **kwargs) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs).stdout


def base_env(commit: str, work: Path) -> tuple[Path, Path]:
    """A worktree of ``commit`` and a venv with its plait installed plus this environment's packages."""
    tree, venv = work / "tree", work / "venv"
    run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit])
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    ours = [line for line in run([sys.executable, "-m", "pip", "freeze"]).splitlines()
            if line and not line.startswith(("-e", "plait")) and "@ file:" not in line]
    (work / "requirements.txt").write_text("\n".join(ours) + "\n")
    run(["bash", "scripts/setup.sh"], cwd=tree, env={**os.environ, "PYTHON": str(python)})
    run([str(python), "-m", "pip", "install", "-q", "-r", str(work / "requirements.txt")])
    return tree, python


def time_suite(python: str, tree: Path, files: list[str]) -> tuple[float, str]:
    env = {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}"}
    start = time.monotonic()
    done = subprocess.run([python, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"], cwd=tree,
                          capture_output=True, text=True, env=env)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return time.monotonic() - start, re.sub(r" in [\d.]+s.*", "", summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--files", nargs="+", default=FILES)
    args = parser.parse_args()
    head = run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip()
    with tempfile.TemporaryDirectory(prefix="plait-suite-time-") as tmp:
        tree, python = base_env(args.base, Path(tmp))
        try:
            rows = []
            for _ in range(args.rounds):
                rows.append((f"HEAD {head}", *time_suite(sys.executable, ROOT, args.files)))
                rows.append((f"base {args.base}", *time_suite(str(python), tree, args.files)))
        finally:
            run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    print("| commit | seconds | tests |\n| --- | --- | --- |")
    for name, seconds, summary in rows:
        print(f"| {name} | {seconds:.0f} | {summary} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
