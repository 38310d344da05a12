"""Where a run's files other than checkpoints go (metrics.jsonl, loss.png, the trackers' local files).

On a disk: ``--output_dir`` itself. For a store (``--output_dir s3://bucket/run``, ``plait.checkpoint.store``):
a folder on rank 0's local disk, whose metrics.jsonl rank 0 copies to the store after every save and, with the loss
curve, when the run ends (``publish``; at its last step, a stop or a divergence), so the store holds the run's
record up to its last checkpoint or its end; a resumed run fetches the store's metrics.jsonl first and appends to
it, as it would on a disk.
"""

from __future__ import annotations

from pathlib import Path

from plait.checkpoint import store

PUBLISHED = ("metrics.jsonl", "loss.png")


class RunFiles:
    """``local``: the folder the run writes its files in; ``url``: the store they are copied to (None on a disk)."""

    def __init__(self, output_dir: str, rank: int, fetch: bool) -> None:
        self.url = output_dir if store.is_url(output_dir) else None
        self.rank = rank
        self.local = store.stage(output_dir, rank) / "run" if self.url else Path(output_dir)
        if self.url and rank == 0:
            self.local.mkdir(parents=True, exist_ok=True)
            for name in PUBLISHED:  # stale copies of an earlier run through this machine
                (self.local / name).unlink(missing_ok=True)
            metrics = self.local / PUBLISHED[0]
            remote = store.join(self.url, PUBLISHED[0])
            if fetch and store.exists(remote):
                store.download(remote, metrics)

    def location(self, name: str) -> str:
        """Where the user finds the run's file ``name``: its URL in the store, else its path."""
        return store.join(self.url, name) if self.url else str(self.local / name)

    def publish(self) -> None:
        """Copy the run's files to the store (rank 0; nothing on a disk)."""
        if self.url is None or self.rank != 0:
            return
        for name in PUBLISHED:
            if (self.local / name).is_file():
                store.upload(self.local / name, store.join(self.url, name))
