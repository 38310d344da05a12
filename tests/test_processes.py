"""The suite's own process runner (tests/processes.py) and the command runner under it (plait.testing.launcher.
run_command): a timeout ends the whole tree, even a grandchild in a session of its own (as torchrun starts its
workers); a command forked from the preloaded server gives back what a fresh one does."""

from __future__ import annotations

import contextlib
import os
import sys

import psutil
import pytest

import processes
from plait.testing import launcher

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


SCRIPT = """
import os, sys
print(os.environ["ONLY_HERE"], os.path.basename(os.getcwd()), sys.argv[1:], "transformers" in sys.modules,
      os.getppid() == int(os.environ["CALLER"]))
print("err", file=sys.stderr)
sys.exit(4)
"""


@pytest.mark.parametrize("how", ["forked", "fresh"])
def test_a_command_gives_back_what_a_fresh_process_does(tmp_path, monkeypatch, how):
    """Its stdout and stderr apart, exit status, environment, cwd and arguments; forked, it starts with the server's
    imports (transformers) and is not the caller's child."""
    monkeypatch.setenv(launcher.LAUNCH_ENV, "fork" if how == "forked" else "subprocess")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "here").mkdir()
    done = launcher.run_command([str(script), "a", "b c"], timeout=60, cwd=tmp_path / "here",
                                env={**os.environ, "ONLY_HERE": "set", "CALLER": str(os.getpid())})
    forked = how == "forked"
    assert (done.returncode, done.stdout, done.stderr) == (4, f"set here ['a', 'b c'] {forked} {not forked}\n",
                                                           "err\n")


@pytest.mark.parametrize("how", ["forked", "fresh"])
def test_a_commands_timeout_kills_every_process_under_it(tmp_path, monkeypatch, how):
    monkeypatch.setenv(launcher.LAUNCH_ENV, "fork" if how == "forked" else "subprocess")
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    with pytest.raises(AssertionError, match="still running after 3s: killed with every process under it") as info:
        launcher.run_command([str(script)], timeout=3)
    grandchild = int(str(info.value).splitlines()[-1])
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(grandchild).wait(timeout=5)
