"""For tests/test_signals.py: stand-ins for torchrun and a worker under plait's ``supervise``.

    signal_tree.py supervise DIR N  plait's side: N times in turn, supervise a stand-in launcher writing DIR/pids-I,
                                    then write its status to DIR/pids-I.status (one start-up of plait for all)
    signal_tree.py launcher PIDS    torchrun's: start a worker, write "launcher_pid worker_pid" to PIDS, wait for it
    signal_tree.py worker           a worker busy in a step that never ends: SIGINT ignored, SIGTERM ends it
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main(role: str, *args: str) -> None:
    if role == "supervise":
        from plait.run.torchrun import supervise

        for i in range(int(args[1])):
            pids = f"{args[0]}/pids-{i}"
            status = supervise([sys.executable, __file__, "launcher", pids])
            Path(f"{pids}.status.tmp").write_text(str(status))  # then renamed: the test never reads it half-written
            Path(f"{pids}.status.tmp").replace(f"{pids}.status")
        return
    pids = args[0] if args else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if role == "worker":
        time.sleep(120)
        return
    worker = subprocess.Popen([sys.executable, __file__, "worker"])
    Path(f"{pids}.tmp").write_text(f"{os.getpid()} {worker.pid}")
    os.replace(f"{pids}.tmp", pids)
    sys.exit(1 if worker.wait() else 0)


if __name__ == "__main__":
    main(*sys.argv[1:])
