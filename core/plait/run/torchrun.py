"""``plait train --nproc_per_node N``: the same command re-run under torchrun, with signals passed on, and its
errors said once.

torchrun runs in a session of its own, so that a terminal's Ctrl-C reaches plait alone, and plait passes each
signal on exactly once: the first SIGINT or SIGTERM goes to every worker (they finish the step, save and stop
together: ``plait.run.stop``), a second one kills torchrun and every process under it at once. On Linux torchrun
also gets SIGTERM if plait itself dies (even by SIGKILL), so no worker is ever left training as an orphan.
torchrun's own grace period before it kills workers it signals (when a scheduler signals it directly) is set
to --ddp_timeout, the bound plait already puts on a step.

Where no accelerator is present the workers are forked, not started as fresh ``python -m plait`` processes that
import torch and transformers again each (plait.base.forking). From a plait command of its own (one thread), torchrun
itself is forked from it before it plans (``ForkedTorchrun``: plait has imported torch, transformers and its trainer
for the plan already), and forks the workers (``--start-method fork``); elsewhere (plait.cli.main called in a
process with threads) torchrun starts fresh and forks them from a server that imported those once (``--start-method
forkserver``). A worker is still the same command: plait/__main__.py run as ``__main__`` (torchrun's ``--run-path``)
with torchrun's environment. bench/launch.py times the three ways.

A worker's error is one ``plait: error:`` line for the whole job, not one per rank under torchrun's report of
the failed worker (a traceback and a 20-line summary). Each worker writes its line to a file in
``PLAIT_ERROR_DIR`` (``report_error``) instead of stderr; torchrun runs in-process here (``python -m
plait.run.torchrun``: its ``run``, without the decorator that prints the report), and after the job plait prints each
distinct line once (a rank's number only where ranks differ) and exits with the worker's status: 2 for bad input,
3 for a diverged run. A worker that died without a line (a crash, a signal) is named with its exit code or signal.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import psutil

from plait.base import forking
from plait.run.runtime import ERROR_DIR  # where each worker writes its one error line (report_error)
from plait.run.stop import SIGNALS

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends SIGTERM when the parent (plait) dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


FORK_SERVED = "--run-path --start-method=forkserver".split()  # torchrun: a script run in processes of that method
FORKED = "--run-path --start-method=fork".split()
MAIN = str(Path(__file__).resolve().parent.parent / "__main__.py")  # what ``python -m plait`` runs
FRESH_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)]


def report_error(message: str) -> None:
    """Say ``message`` (a ``plait: error:`` line): on stderr, or under plait's launcher into this rank's file, so
    that the job says it once."""
    folder = os.environ.get(ERROR_DIR)
    if not folder:
        print(message, file=sys.stderr)
        return
    path = Path(folder) / f"rank{os.environ.get('RANK', '0')}.txt"
    path.with_suffix(".tmp").write_text(message)
    path.with_suffix(".tmp").replace(path)


def run_under_torchrun(argv: list[str], nproc: int, grace_s: int, max_restarts: int = 0,
                       forked: ForkedTorchrun | None = None) -> int:
    """Run ``python -m plait argv`` on ``nproc`` local processes (forked where ``forking_is_safe``), restarted up to
    ``max_restarts`` times after a failure; return the exit status to exit with: the job's (a worker's own, for its
    error), or 128 + the signal that stopped it. ``forked``: torchrun forked from this process already, waiting."""
    options = ["--standalone", f"--nproc_per_node={nproc}", f"--shutdown_timeout={grace_s}",
               f"--max-restarts={max_restarts}"]
    with tempfile.TemporaryDirectory(prefix="plait-errors-") as folder:
        if forked is not None:
            status = forked.run([*options, *FORKED, MAIN, *argv], {ERROR_DIR: folder})
        else:
            worker = [*FORK_SERVED, MAIN] if forking.forking_is_safe() else ["-m", "plait"]
            status = supervise([sys.executable, "-m", "plait.run.torchrun", *options, *worker, *argv],
                               {**os.environ, ERROR_DIR: folder})
        say_once(Path(folder), nproc)
        return status


def launch(nproc: int, grace_s: int, check: Callable[[], list[str]], max_restarts: int = 0) -> None:
    """The launching side of ``plait train`` or ``plait generate`` with ``--nproc_per_node N``: torchrun forked first
    where it can be (``ForkedTorchrun``: before ``check`` may start threads), then ``check()``, which refuses bad
    input in one line here rather than one per worker and returns the command the workers run; then torchrun on it
    (ended unstarted if ``check`` raised). Exits with a failed job's status; returns after one that succeeded, as a
    run on one process does (plait.cli.main can be called from a script: examples/sft_chat.py)."""
    forked = ForkedTorchrun() if ForkedTorchrun.possible() else None
    try:
        argv = list(check())
        if "--nproc_per_node" in argv:  # the workers are the processes; they run the command as given otherwise
            i = argv.index("--nproc_per_node")
            del argv[i : i + 2]
        status = run_under_torchrun(argv, nproc, grace_s, max_restarts, forked)
    finally:
        if forked is not None:
            forked.close()
    if status:
        sys.exit(status)


class ForkedTorchrun:
    """torchrun, forked from ``plait train --nproc_per_node N`` before it plans the run, waiting for the word to
    start. The launching process imports torch, transformers and plait's trainer for its plan anyway; a fresh
    torchrun (``python -m plait.run.torchrun``) and its fork server imported them again, about 4 and 10 CPU-seconds
    on a 2-core VM. Forked before the plan, it holds nothing the plan did (threads of a tokenizer, OpenMP's pool):
    what the fork server held, imports. ``run`` sends the command (the plan may have chosen the layout) and
    supervises it; ``close`` without ``run`` (bad input refused, an error) ends it with nothing started.

    Only where workers may be forked at all (``forking_is_safe``) and from a process of one thread (``possible``):
    a fork copies only the calling thread, and another's locks would stay held in the copy (plait.cli.main called
    in a test runner, which has threads, starts torchrun fresh instead)."""

    @staticmethod
    def possible() -> bool:
        return forking.forking_is_safe() and hasattr(os, "fork") and threading.active_count() == 1

    def __init__(self) -> None:
        for name in forking.PRELOAD:  # what the plan imports too: here, before the fork, so that torchrun has them
            __import__(name)
        read, self._order = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        launcher = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._order)
            status = 1
            try:
                status = _wait_then_torchrun(read, launcher)
            except BaseException:  # noqa: BLE001 (a child of the launcher: say it, never run its code on)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        os.close(read)

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """Start torchrun on ``argv`` with ``env`` added to its environment; its exit status (``supervised``)."""
        with os.fdopen(self._order, "wb") as order:
            order.write(json.dumps([argv, env]).encode())
        self._order = None
        return supervised(self.pid, lambda: os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1]))

    def close(self) -> None:
        """End it unstarted (a no-op after ``run``)."""
        if self._order is not None:
            os.close(self._order)
            self._order = None
            os.waitpid(self.pid, 0)


def _fresh_signal_handlers() -> None:
    """A fresh interpreter's signal handlers: in the forked torchrun, and again in each worker it forks, where
    torchrun's own (SIGTERM raising its SignalException) would stay (a fork keeps Python's handlers)."""
    for signum in FRESH_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _wait_then_torchrun(read: int, launcher: int) -> int:
    """In the forked torchrun: wait for the command, then be what ``python -m plait.run.torchrun`` is."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C while the launcher plans is the launcher's to take
    with os.fdopen(read, "rb") as order:
        words = order.read()
    if not words:  # the launcher closed it: nothing to start
        return 0
    argv, env = json.loads(words)
    os.setsid()  # as supervise's torchrun: a terminal's Ctrl-C reaches the launcher alone, which passes it on
    if sys.platform == "linux":
        _die_with_parent()
    if os.getppid() != launcher:  # it died before the line above
        return 1
    _fresh_signal_handlers()
    torchrun = os.getpid()
    os.register_at_fork(after_in_child=lambda: os.getppid() == torchrun and _fresh_signal_handlers())
    os.environ.update(env)
    forking.one_thread_unless_set()  # the workers forked next keep torch loaded here, with this count
    # what torchrun's ``python -u`` gives a fresh worker: its lines as they are written, on the process's own stdout
    # and stderr (not a stream the launcher's caller may have put in their place)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                               encoding=stream.encoding, errors=stream.errors)
                              for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
    return _torchrun(argv)


def say_once(folder: Path, nproc: int) -> None:
    """Print how the job failed, once: a worker killed by a signal (the culprit: the others' errors follow from
    it), else each distinct error line the workers wrote, with the ranks that said it where not every rank of
    the ``nproc`` said the same, else how the first failed worker ended."""
    lines = {int(p.stem.removeprefix("rank")): p.read_text() for p in folder.glob("rank*.txt")}
    failed = (folder / "failed.txt").read_text() if (folder / "failed.txt").exists() else None
    if failed and " was killed by " in failed:
        print(f"plait: error: {failed}", file=sys.stderr)
        return
    distinct = list(dict.fromkeys(lines.values()))
    for line in distinct:
        ranks = sorted(r for r, text in lines.items() if text == line)
        named = len(distinct) > 1 or len(ranks) < nproc
        prefix = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: " if named else ""
        print(line.replace("plait: error: ", f"plait: error: {prefix}", 1), file=sys.stderr)
    if not lines and failed:
        print(f"plait: error: {failed}", file=sys.stderr)


def _torchrun(argv: list[str]) -> int:
    """torchrun's ``run`` on ``argv``, with its report of a failed worker replaced by one line in PLAIT_ERROR_DIR
    (``failed.txt``: the culprit rank and how it ended); the failed worker's exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its "failed (exitcode...)" lines
    # and its teardown of the other ranks once one failed ("Terminating process N via signal SIGTERM"): the job's
    # one line names the rank that failed
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    if FORK_SERVED[1] in argv:  # the server starts with the first worker, from this environment
        multiprocessing.set_forkserver_preload(forking.PRELOAD)
        os.environ["PYTHONUNBUFFERED"] = "1"  # what torchrun's ``python -u`` gives a fresh worker
    grace_for_the_rest(next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--shutdown_timeout=")))
    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        rank, failure = culprit(err.failures)
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else \
            f"exited with code {failure.exitcode}"
        (Path(os.environ[ERROR_DIR]) / "failed.txt").write_text(
            f"worker rank {rank} ({socket.gethostname()}, pid {failure.pid}) {how}")
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def grace_for_the_rest(seconds: int) -> None:
    """After one worker fails, torchrun ends the others with SIGTERM and, 30 s later (a fixed default of its
    ``PContext.close``, not its --shutdown_timeout, and of torch.multiprocessing's ``ProcessContext.join`` where the
    workers are forked), SIGKILL. A worker stopped by SIGSTOP (a frozen host) takes SIGTERM only when it runs again,
    so it is the SIGKILL that ends it: give that the same grace as the rest of plait, --ddp_timeout."""
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.multiprocessing import ProcessContext

    close = PContext.close
    PContext.close = lambda self, death_sig=None, timeout=seconds: close(self, death_sig, timeout)
    wait = ProcessContext._join_procs_with_timeout  # its only caller: join's waits after a worker failed
    ProcessContext._join_procs_with_timeout = lambda self, timeout: wait(self, min(timeout, seconds))


def culprit(failures: dict) -> tuple[int, object]:
    """The failure to name, among those torchrun saw first (it also reports the workers it then ended itself, with
    SIGTERM or, after its grace, SIGKILL, at a later time): a worker a signal other than SIGTERM ended (SIGKILL
    from an out-of-memory killer, SIGSEGV), whose peers fail on the lost connection in the same moment, else the
    lowest rank that failed by itself (exit status), not one torchrun ended (SIGTERM)."""
    first = min(f.timestamp for f in failures.values())
    seen_first = sorted((r, f) for r, f in failures.items() if f.timestamp == first)
    killed = [(r, f) for r, f in seen_first if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]
    failed = [(r, f) for r, f in seen_first if f.exitcode > 0]
    return (killed or failed or seen_first)[0]


def supervise(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` (a launcher whose children are the workers) in a session of its own, dying with this
    process, under ``supervised``."""
    launcher = subprocess.Popen(cmd, start_new_session=True, env=env,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    return supervised(launcher.pid, launcher.wait)


def supervised(launcher: int, wait: Callable[[], int]) -> int:
    """Wait for process ``launcher`` (``wait``: its exit status); meanwhile pass the first SIGINT or SIGTERM to its
    children (to itself while it has none), and on a second kill it and everything under it. Returns its exit
    status, or 128 + the first signal."""
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        try:
            if len(received) > 1:  # the second signal: everything stops now
                for proc in [*psutil.Process(launcher).children(recursive=True), psutil.Process(launcher)]:
                    proc.kill()
                return
            # none started yet: the launcher stops itself
            for proc in workers(launcher) or [psutil.Process(launcher)]:
                proc.send_signal(signum)
        except psutil.NoSuchProcess:
            pass  # already gone

    previous = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        status = wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 + received[0] if received else status


def workers(launcher: int) -> list[psutil.Process]:
    """torchrun's workers: its children, or where they are forked, the fork server's (torchrun's other child,
    multiprocessing's resource tracker, is no worker)."""
    found = []
    for child in psutil.Process(launcher).children():
        command = " ".join(child.cmdline())
        if "from multiprocessing.forkserver " in command:
            found += child.children()
        elif "from multiprocessing." not in command:
            found.append(child)
    return found


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
