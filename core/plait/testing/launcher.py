"""Launch a world of worker processes on this machine with a watchdog.

A distributed test must never hang and never hide which rank failed: the first rank to exit non-zero
ends every other rank at once, and a world that outlives ``timeout`` is killed whole; either way the
error names the rank and shows the end of its output. Workers get the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so any torchrun script can be a worker.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


class WorkerFailure(AssertionError):
    """A worker rank failed or the world timed out; the message carries the rank's output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def launch(
    argv: Sequence[str], world_size: int, *, timeout: float, env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> list[str]:
    """Run ``python argv...`` as ``world_size`` ranks; return each rank's combined output on success."""
    port = free_port()
    logdir = Path(tempfile.mkdtemp(prefix="plait-launch-"))
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = logdir / f"rank{rank}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, cwd=cwd, stdout=out,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                rank = bad[0]
                failure = f"rank {rank} exited with code {codes[rank]}; other ranks were stopped.\n" \
                          f"--- rank {rank} output ---\n{_tail(logs[rank])}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                outputs = "\n".join(f"--- rank {r} output ---\n{_tail(logs[r], 2000)}" for r in range(world_size))
                failure = f"world of {world_size} timed out after {timeout:.0f}s (a hang); all ranks killed.\n{outputs}"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    if failure:
        raise WorkerFailure(failure)
    return [log.read_text(errors="replace") for log in logs]
