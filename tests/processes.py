"""``run``: ``subprocess.run`` for commands that start process trees (plait's launcher, torchrun, their
workers), whose timeout ends the whole tree. ``subprocess.run`` kills only its direct child on a timeout, and
torchrun starts each worker in a session of its own, so a hung test could leave workers training; here every
descendant, found while the tree is whole, is killed too."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Sequence

import psutil


def run(cmd: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing text output (``kwargs`` as for Popen: env, cwd, preexec_fn); on a timeout kill
    it and every process under it, then fail naming the command and showing its output's tail."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(psutil.NoSuchProcess):
                tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
                for child in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(map(str, cmd))[:200]} still running after {timeout}s: killed with every "
                                 f"process under it\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
