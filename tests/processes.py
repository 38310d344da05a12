"""``run``: ``subprocess.run`` for commands that start process trees (plait's launcher, torchrun, their
workers), whose timeout ends the whole tree. ``subprocess.run`` kills only its direct child on a timeout, and
torchrun starts each worker in a session of its own, so a hung test could leave workers training; here every
descendant, found while the tree is whole, is killed too. A ``python -m plait ...`` command is forked from the
suite's preloaded server (plait.testing.launcher.run_command: its ~5 CPU-seconds of imports paid once, not per
command; a fresh process where ranks are fresh), unless ``fresh=True`` or a ``preexec_fn`` asks for a process of
its own; a test about start-up itself (tests/test_cli_commands.py) starts one directly.

``run_script``: ``python SCRIPT ARGS`` run in this process, for examples that start plait's own commands
themselves: the script's own start-up (torch, transformers, peft: ~8 s) is one the test process has paid already."""

from __future__ import annotations

import runpy
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


from plait.testing import launcher


def run(cmd: Sequence[str], *, timeout: float, fresh: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing text output (``kwargs`` as for Popen: env, cwd, preexec_fn); on a timeout kill
    it and every process under it, then fail naming the command and showing its output's tail."""
    if not fresh and list(cmd[:3]) == [sys.executable, "-m", "plait"] and set(kwargs) <= {"env", "cwd"}:
        return launcher.run_command(cmd[1:], timeout=timeout, **kwargs)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launcher.kill_tree(proc.pid)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(map(str, cmd))[:200]} still running after {timeout}s: killed with every "
                                 f"process under it\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_script(script: Path, args: Sequence[str], monkeypatch) -> None:
    """Run ``script`` as ``python script args...`` runs it (``__main__``, ``sys.argv``, its directory first on
    ``sys.path``), in this process and the script's directory's parent as the cwd; what it prints reaches pytest's
    capture (``capfd`` also holds its subprocesses' output). It raises what the script raises; a non-zero
    ``sys.exit`` fails with its status."""
    monkeypatch.chdir(script.parent.parent)
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (None, 0), f"{script.name} exited with {exit_.code}"
