"""``plait train --nproc_per_node N``: the same command re-run under torchrun, with signals passed on.

torchrun runs in a session of its own, so that a terminal's Ctrl-C reaches plait alone, and plait passes each
signal on exactly once: the first SIGINT or SIGTERM goes to every worker (they finish the step, save and stop
together: ``plait.stop``), a second one kills torchrun and every process under it at once. On Linux torchrun
also gets SIGTERM if plait itself dies (even by SIGKILL), so no worker is ever left training as an orphan.
torchrun's own grace period before it kills workers it signals (when a scheduler signals it directly) is set
to --ddp_timeout, the bound plait already puts on a step.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from types import FrameType

import psutil

from plait.stop import SIGNALS

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the parent (plait) dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_under_torchrun(argv: list[str], nproc: int, grace_s: int) -> int:
    """Run ``python -m plait argv`` on ``nproc`` local processes; return the exit status to exit with: the
    job's, or 128 + the signal that stopped it."""
    return supervise([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                      f"--shutdown_timeout={grace_s}", "-m", "plait", *argv])


def supervise(cmd: list[str]) -> int:
    """Run ``cmd`` (a launcher whose children are the workers) in a session of its own, dying with this
    process; pass the first SIGINT or SIGTERM to its children (to itself while it has none), and on a second
    kill it and everything under it. Returns its exit status, or 128 + the first signal."""
    launcher = subprocess.Popen(cmd, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        try:
            if len(received) > 1:  # the second signal: everything stops now
                for proc in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)]:
                    proc.kill()
                return
            workers = psutil.Process(launcher.pid).children()
            for proc in workers or [psutil.Process(launcher.pid)]:  # none started yet: the launcher stops itself
                proc.send_signal(signum)
        except psutil.NoSuchProcess:
            pass  # already gone

    previous = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        status = launcher.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 + received[0] if received else status
