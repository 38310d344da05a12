"""Launch a world of worker processes on this machine with a watchdog.

A distributed test must never hang and never hide which rank failed: the first rank to exit non-zero
ends every other rank at once, and a world that outlives ``timeout`` is killed whole; either way the
error names the rank and shows the end of its output. Workers get the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so any torchrun script can be a worker.

Two ways to start the ranks, the same watchdog over both:
- a fresh ``python`` per rank (the default): nothing shared with the caller;
- forked from a server that has imported torch and transformers once (``PLAIT_LAUNCH=fork``, what the test
  suite sets): a rank then starts in a fraction of a second instead of paying ~6-10 s of imports, which is
  most of a small world's time (docs/decisions.md D8). The server is the standard library's
  ``multiprocessing`` forkserver, started on first use and gone with the caller. A forked rank runs its
  script as ``python`` would (``__main__``, ``sys.argv``, the script's directory or the cwd first on
  ``sys.path``) with the environment it was given; what the preloaded modules read from the environment at
  import time is the only thing it cannot change (``FORK_PRELOAD``: plait.base.forking's list, which plait's
  own launcher uses too, and the test suite's models). As with any
  multiprocessing start, the caller's main script is imported in each rank under ``__mp_main__`` (a
  ``__name__ == "__main__"`` guard keeps its body from running); a caller whose main is no file
  (``python -``) gets fresh processes. So does a caller on a machine with an accelerator
  (``plait.base.forking.forking_is_safe``; tests/test_launcher.py names the error measured on an H100).

``run_command`` starts one command the same two ways, without a world's variables, its stdout and stderr apart.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from plait.base import forking

LAUNCH_ENV = "PLAIT_LAUNCH"  # "fork": ranks forked from a preloaded server; anything else: fresh processes
# Imported once by the fork server: the costly part of every worker's start-up, and the tests' two models.
FORK_PRELOAD = [*forking.PRELOAD, "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"]


class WorkerFailure(AssertionError):
    """A worker rank failed or the world timed out; the message carries the rank's output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


class _Rank:
    """One running process (a rank or a command), whichever way it was started: its ``pid``, ``poll()`` (None while
    running, else the exit code, negative for a signal) and ``kill()``, which also reaps it."""

    def __init__(self, pid: int, poll: Callable[[], int | None], kill: Callable[[], None]):
        self.pid, self.poll, self.kill = pid, poll, kill


def _start_subprocess(argv: Sequence[str], env: dict[str, str], cwd: str | None, log: Path,
                      err_log: Path | None = None) -> _Rank:
    """A fresh ``python argv...``, its output to ``log`` (its stderr to ``err_log`` where given)."""
    with contextlib.ExitStack() as files:
        out = files.enter_context(open(log, "wb"))
        err = files.enter_context(open(err_log, "wb")) if err_log else subprocess.STDOUT
        proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=out, stderr=err)

    def kill() -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    return _Rank(proc.pid, proc.poll, kill)


def _fork_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_PRELOAD)
    return context


def _main_is_importable() -> bool:
    """Whether a forked rank can import the caller's main module, as multiprocessing does before the target
    runs: run by module name (``python -m pytest``), or from a file that exists (not stdin or ``-c``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return getattr(getattr(main, "__spec__", None), "name", None) is not None or path is None or os.path.isfile(path)


def _fork_is_safe() -> bool:
    """Forked ranks only where no accelerator is present: see the module's docstring."""
    return _main_is_importable() and forking.forking_is_safe()


def _forks() -> bool:
    """Whether processes are forked from the preloaded server here (``PLAIT_LAUNCH=fork`` where that is safe)."""
    return os.environ.get(LAUNCH_ENV) == "fork" and _fork_is_safe()


def _start_forked(argv: Sequence[str], env: dict[str, str], cwd: str | None, log: Path,
                 err_log: Path | None = None) -> _Rank:
    """``python argv...`` forked from the preloaded server, its output as ``_start_subprocess`` sends it."""
    args = (list(argv), env, cwd, str(log), None if err_log is None else str(err_log))
    process = _fork_context().Process(target=_run_forked, args=args, daemon=False)
    process.start()

    def kill() -> None:
        if process.exitcode is None:
            process.kill()
        process.join()
        process.close()

    return _Rank(process.pid, lambda: process.exitcode, kill)


def _redirect(path: str, *fds: int) -> None:
    """Point the file descriptors ``fds`` at a new file ``path`` (truncated)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for target in fds:
        os.dup2(fd, target)
    os.close(fd)


def _run_forked(argv: list[str], env: dict[str, str], cwd: str | None, log: str, err_log: str | None = None) -> None:
    """In the forked rank: become ``python argv...`` with ``env`` in ``cwd``, output to ``log`` (its stderr to
    ``err_log`` where given); exit with the code the script would have exited with."""
    if err_log:
        _redirect(log, 1)
        _redirect(err_log, 2)
    else:
        _redirect(log, 1, 2)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    extra_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # OpenMP read the variable in the server
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            sys.path[:0] = [os.getcwd(), *extra_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [script, *argv[1:]]
            sys.path[:0] = [os.path.dirname(script), *extra_path]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as an interpreter exit would: the multiprocessing exit skips them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(
    argv: Sequence[str], world_size: int, *, timeout: float, env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> list[str]:
    """Run ``python argv...`` as ``world_size`` ranks; return each rank's combined output on success."""
    port = free_port()
    logdir = Path(tempfile.mkdtemp(prefix="plait-launch-"))
    start = _start_forked if _forks() else _start_subprocess
    ranks, logs = [], []
    deadline = time.monotonic() + timeout
    failure = None
    try:
        for rank in range(world_size):
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            logs.append(logdir / f"rank{rank}.log")
            logs[-1].touch()  # a rank that dies before writing a line still has a (empty) log to show
            ranks.append(start(argv, rank_env, None if cwd is None else str(cwd), logs[-1]))
        while True:
            codes = [r.poll() for r in ranks]
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
        for r in ranks:
            r.kill()
    if failure:
        raise WorkerFailure(failure)
    return [log.read_text(errors="replace") for log in logs]


def run_command(argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``python argv...`` as one command (no world around it: plait's own launcher starts any), its stdout and
    stderr captured apart as ``subprocess.run`` captures them. Forked from the ranks' preloaded server where ranks
    are (``_forks``): a ``plait`` command then starts without its ~5 CPU-seconds of imports, which a suite running
    a few dozen real commands paid for each; a fresh process otherwise. On a timeout the command and every process
    under it are killed and an AssertionError names it with its stderr's tail."""
    logdir = Path(tempfile.mkdtemp(prefix="plait-command-"))
    out, err = logdir / "stdout", logdir / "stderr"
    env = dict(os.environ if env is None else env)
    cwd = None if cwd is None else str(cwd)
    process = (_start_forked if _forks() else _start_subprocess)(argv, env, cwd, out, err)
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    code = process.poll()
    if code is None:
        kill_tree(process.pid)
    process.kill()  # reaps it
    stdout, stderr = (path.read_text(errors="replace") for path in (out, err))
    shutil.rmtree(logdir, ignore_errors=True)
    if code is None:
        raise AssertionError(f"{' '.join(map(str, argv))[:200]} still running after {timeout}s: killed with every "
                             f"process under it\n{stderr[-3000:]}")
    return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def kill_tree(pid: int) -> None:
    """Kill process ``pid`` and every process under it, found while the tree is whole (torchrun starts its workers
    in sessions of their own, so a process group would miss them)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
