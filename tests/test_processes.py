"""The suite's own process runner (tests/processes.py): a timeout ends the whole tree, even a grandchild in a
session of its own (as torchrun starts its workers)."""

from __future__ import annotations

import contextlib
import sys

import psutil
import pytest

import processes

TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # not holding the pipes open
print(child.pid, file=sys.stderr, flush=True)
time.sleep(120)
"""


def test_a_timeout_kills_every_process_under_the_command(tmp_path):
    with pytest.raises(AssertionError, match="still running after 3s: killed with every process under it") as info:
        processes.run([sys.executable, "-c", TREE], timeout=3)
    grandchild = int(str(info.value).splitlines()[-1])  # its pid, printed by the command on stderr
    with contextlib.suppress(psutil.NoSuchProcess):  # gone already, or within 5 s (else TimeoutExpired fails)
        psutil.Process(grandchild).wait(timeout=5)


def test_output_and_status_come_back():
    done = processes.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                         timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
