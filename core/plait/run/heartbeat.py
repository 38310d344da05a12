"""Which rank a failed collective waited for: each rank's heartbeat in the rendezvous store.

When a collective times out (--ddp_timeout) or loses its peer, the backend only says that it waited, not for
whom. So every rank of a training run publishes, once a second from a thread of its own, where it is: its host,
pid, step and phase (``data``, ``forward-backward``, ``optimizer``, ``evaluation``, ``save``), its last step's own
time (``plait.run.stragglers``) and a beat counter, under ``plait/heartbeat/<attempt>/<rank>`` in the store
torchrun (or any ``env://`` launcher) serves at MASTER_ADDR:MASTER_PORT, and again at once whenever its phase
changes. A rank whose collective failed reads
every rank's entry twice, a few beats apart:

- a rank whose counter did not move has stopped responding (SIGSTOP, a frozen host, a dead process): the whole
  process stands still, its thread too;
- otherwise a rank whose (step, phase) is behind the others' is stuck in its own work (it still beats, but
  its step does not move on).

Publishing costs a small store write per phase (five per step) and one a second; counters, not clocks, decide, so
hosts' clocks need not agree.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time

import torch.distributed as dist

PHASES = ("data", "forward-backward", "optimizer", "evaluation", "save")
INTERVAL_S = 1.0


def _key(rank: int) -> str:
    return f"plait/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _client() -> dist.Store | None:
    """A client of the launcher's store, or None where the world was not started through one."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    except (RuntimeError, ValueError):  # no store there (a world built another way): run without heartbeats
        return None


class Heartbeat:
    """This rank's heartbeat: ``at(step, phase)`` publishes where the main thread is, and a daemon thread publishes
    it again every ``interval_s`` with the beat counter moved on (a process that stops stops both)."""

    def __init__(self, rank: int, world_size: int, store: dist.Store | None, interval_s: float = INTERVAL_S) -> None:
        self.rank, self.world_size, self.store, self.interval_s = rank, world_size, store, interval_s
        self.step, self.phase = 0, "start"
        self.step_s = 0.0  # the time of this rank's own work in its last step (plait.run.stragglers)
        self._host, self._pid, self._beat = socket.gethostname(), os.getpid(), 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @classmethod
    def start(cls, rank: int, world_size: int) -> "Heartbeat":
        """Begin publishing (a world of one, or one without a store, publishes nothing: nobody waits for it)."""
        beat = cls(rank, world_size, _client() if world_size > 1 else None)
        if beat.store is not None:
            beat._publish()
            threading.Thread(target=beat._run, name="plait-heartbeat", daemon=True).start()
        return beat

    def at(self, step: int, phase: str) -> None:
        """Say where this rank is now (a small write to the store: a few per step)."""
        self.step, self.phase = step, phase
        if self.store is not None:
            self._publish()

    def close(self) -> None:
        self._stop.set()

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
            record = {"host": self._host, "pid": self._pid, "step": self.step, "phase": self.phase, "beat": self._beat,
                      "step_s": round(self.step_s, 4)}
            try:
                self.store.set(_key(self.rank), json.dumps(record))
            except (RuntimeError, OSError):  # the store went away (the job is ending): nothing left to tell
                self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._publish()

    def read(self) -> dict[int, dict]:
        """Every rank's last published record (ranks that never published are left out)."""
        found = {}
        for rank in range(self.world_size):
            if self.store.check([_key(rank)]):
                found[rank] = json.loads(self.store.get(_key(rank)))
        return found

    def host_of(self, rank: int) -> str:
        """The host ``rank`` published (this rank's own where there is no store, or it has not published)."""
        if self.store is None or rank == self.rank:
            return self._host
        try:
            return json.loads(self.store.get(_key(rank)))["host"] if self.store.check([_key(rank)]) else "host unknown"
        except (RuntimeError, OSError):
            return "host unknown"

    def culprit(self, wait_s: float | None = None) -> str | None:
        """Which rank the others wait for, in words (host, pid, step, phase), or None where it cannot be told."""
        if self.store is None:
            return None
        try:
            first = self.read()
            time.sleep(2.5 * self.interval_s if wait_s is None else wait_s)
            second = self.read()
        except (RuntimeError, OSError):
            return None
        return describe_culprits(first, second, self.rank)


def _where(record: dict) -> str:
    return f"step {record['step']}, phase {record['phase']}"


def _who(rank: int, record: dict) -> str:
    return f"rank {rank} ({record['host']}, pid {record['pid']})"


def describe_culprits(first: dict[int, dict], second: dict[int, dict], me: int) -> str | None:
    """From two readings of the heartbeats: the ranks that stopped (counter still), else those behind."""
    stopped = [r for r in sorted(second) if r != me and r in first and first[r]["beat"] == second[r]["beat"]]
    if stopped:
        return "; ".join(f"{_who(r, second[r])} stopped responding at {_where(second[r])}" for r in stopped)
    order = {r: (rec["step"], PHASES.index(rec["phase"]) if rec["phase"] in PHASES else -1)
             for r, rec in second.items()}
    if not order or len(set(order.values())) == 1:
        return None
    ahead = max(order.values())
    behind = [r for r in sorted(order) if order[r] < ahead]
    leader = next(r for r in sorted(order) if order[r] == ahead)
    return "; ".join(f"{_who(r, second[r])} is stuck at {_where(second[r])} (it still runs, but the others reached "
                     f"{_where(second[leader])})" for r in behind)
