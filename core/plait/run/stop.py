"""Stopping a run on SIGTERM or SIGINT without losing it.

A scheduler sends SIGTERM before it ends a job (Slurm at the time limit or on preemption, Kubernetes on
eviction); a user presses Ctrl-C. The first such signal asks the run to stop after the step in progress. A
signal can reach the ranks at different moments, or only some of them, so the ranks agree on it: one
all-reduce of the signal number over the world after every step, after which every rank stops at the same
step, writes that step's checkpoint together (--save_on_signal, the default) and ends with ``StopRequested``.
A second SIGINT stops at once (KeyboardInterrupt): nothing more is saved, and the last complete checkpoint
stays what ``--resume_from_checkpoint auto`` picks (a save cut short is never taken for one).

A rank that cannot reach the end of its step cannot stop this way: torchrun also sends SIGTERM to the ranks
left when one has failed, and a rank stuck outside any collective would then wait for a step that never ends.
So the first signal also starts a grace period, --ddp_timeout (the bound plait puts on any wait of a step):
a rank still running after it ends itself, naming its rank, the signal and the grace it was given.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType


SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(Exception):
    """The run stopped early on a signal, at the same step on every rank; ``saved``: the checkpoint written."""

    def __init__(self, signum: int, step: int, max_steps: int, saved: str | None, last: str | None) -> None:
        self.signum, self.step = signum, step
        name = signal.Signals(signum).name
        if saved:
            after = f"saved {saved}; continue with --resume_from_checkpoint auto"
        else:
            after = (f"no checkpoint saved (--no_save_on_signal); the last is {last}" if last
                     else "no checkpoint saved (--no_save_on_signal), none on disk")
        super().__init__(f"stopped by {name} after step {step} of {max_steps}; {after}")

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a process that a signal ended."""
        return 128 + self.signum


class StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM set ``signum`` instead of ending the process;
    a second SIGINT raises KeyboardInterrupt. The caller agrees on ``signum`` over the ranks (a max-reduction)."""

    def __init__(self, announce: bool, grace_s: float) -> None:
        self.signum = 0
        self.announce = announce  # rank 0 says at once that the signal was heard
        self.grace_s = grace_s
        self._previous: dict[int, object] = {}
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._deadline is not None:
            self._deadline.cancel()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum:
            return  # a scheduler may send SIGTERM again: the stop is already under way
        self.signum = signum
        if self.announce:  # os.write: safe at any point a handler runs, unlike a buffered print
            os.write(2, f"plait: {signal.Signals(signum).name} received: stopping after this step (a second "
                        f"Ctrl-C stops at once)\n".encode())
        self._deadline = threading.Timer(self.grace_s, self._give_up)
        self._deadline.daemon = True
        self._deadline.start()

    def _give_up(self) -> None:
        """The grace period ran out (a step or a save that does not end): end this process now."""
        rank = os.environ.get("RANK", "0")
        os.write(2, f"plait: rank {rank} did not stop within --ddp_timeout={self.grace_s:g}s of "
                    f"{signal.Signals(self.signum).name} (its step or save did not end); ending it\n".encode())
        os._exit(128 + self.signum)
