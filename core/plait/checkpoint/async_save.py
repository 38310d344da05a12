"""``--save_async``: a checkpoint written in the background while training goes on.

A save has two halves (``plait.checkpoint.save``). The first, ``prepare_save``, runs on the training thread at the
step being saved: every rank gathers the metadata and learns which boxes it writes, then copies those tensors to
host memory (``PendingSave.host_copy``), so the next optimizer step may change its own at once. The second,
``write_save``, runs on a thread of its own: the files, rank 0's index and the rename (or uploads and the commit
object), as a synchronous save does. Its collectives run on a gloo group of their own, created once by every rank,
so they never interleave with the training's on the world's group.

The next save waits for the previous one to finish (one in flight, so one host copy at a time, whose tensors the
next save copies into: allocated once), and so does the end of the run, the last checkpoint included. A write that
fails raises CheckpointNotSaved on every rank at the end of the step during which it failed (``failed``, which the
trainer's per-step gather shares), not at the next save, which may be hours of training away. A collective of the
write that waits longer than --ddp_timeout (the group is given it: torch's default for a new group is 30 minutes) or
loses its peer raises the backend's error at that wait too, on the training thread, where the trainer's
``explain_timeouts`` names the rank waited for in one line, as for a synchronous save.
A crash while a write is in the background leaves its checkpoint a ``.tmp`` folder (no commit object in a store),
which ``--resume_from_checkpoint auto`` ignores: the previous checkpoint stays the newest.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from plait.base import comm
from plait.checkpoint.save import PendingSave, write_save


class BackgroundSaver:
    """Writes one checkpoint at a time in the background. Every rank creates it at the same point (the group it
    builds is collective) and calls ``start`` and ``wait`` at the same steps. ``timeout``: --ddp_timeout, so that a
    peer that stopped responding mid-write ends the job as soon as a synchronous save would, not after 30 minutes."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timeout) if comm.world_group() is not None else None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.buffers: list[torch.Tensor] = []  # the last save's host copies, reused by the next once it is written

    def start(self, pending: PendingSave, done: Callable[[Path | str], None]) -> None:
        """Wait for the previous save, copy ``pending``'s tensors to host memory, and write them in the background;
        ``done(path)`` runs there once the checkpoint is complete."""
        self.wait()
        pending.host_copy(self.buffers)
        self.buffers = [t.tensor for t in pending.tensors]

        def write() -> None:
            try:
                done(write_save(pending, self.group))
            except BaseException as err:  # raised on the training thread at the next wait
                self.error = err

        self.thread = threading.Thread(target=write, name=f"plait-save-{pending.step}", daemon=True)
        self.thread.start()

    def failed(self) -> bool:
        """Whether the save in flight has ended with an error (which ``wait`` raises); never waits."""
        return self.thread is not None and not self.thread.is_alive() and self.error is not None

    def wait(self) -> None:
        """Return once no save is in flight; raise the error the last one ended with, if any."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error
