"""Stragglers named: the rank whose own work in a step takes much longer than the others' does.

In a synchronous job every rank's step takes as long as the slowest rank's: the others wait for it in the next
collective. So what tells a straggler apart is the time a rank spends on its own part of the step before it first
waits for the data-parallel world: from the step's start (its data) to the moment it offers its loss to the
step's reduction. The trainer measures that on every rank, puts it in the heartbeat (``plait.run.heartbeat``: a
rank named on a timeout comes with its last step time) and gathers every rank's in the collective it already runs
at each step's end (peak memory, a stop signal), so naming costs no collective of its own.

``StragglerWatch`` then runs the same arithmetic on every rank: a rank whose time is over ``RATIO`` x the median
of the other ranks' at ``PATIENCE`` steps in a row is named once (rank, host, its mean ratio over those steps), and the
step records count the ranks named so far (``stragglers`` in metrics.jsonl). One slow step (a page fault, a
checkpoint's copy) does not name anyone; a host that stays slow does. The others' median, not all ranks': in a
world of two that median held the slow rank's own time (the mean of both), so a rank 3x slower than its peer
measured 1.5x and was never named, and the ratio printed could not pass 2.

Within a tensor-, pipeline- or context-parallel group the ranks wait for each other inside the step too, so a
slow rank there slows its group's measured time alike: the group's ranks are named together, and the one among
them that is slow is the one its peers' heartbeats wait for (``describe_culprits``) when it stops altogether.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

RATIO = 1.5  # slower than this many times the median step time ...
PATIENCE = 20  # ... at this many steps in a row: named


@dataclass
class StragglerWatch:
    """Consecutive slow steps per rank, over the step times of every rank (the same on every rank: each runs it on
    the gathered times, so each agrees on who is named)."""

    world_size: int
    ratio: float = RATIO
    patience: int = PATIENCE
    runs: list[int] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    named: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.runs = [0] * self.world_size
        self.ratios = [0.0] * self.world_size

    def observe(self, times: list[float]) -> list[tuple[int, float]]:
        """Take one step's time of every rank; return the ranks named at this step with their mean ratio to the
        others' median over the slow run that named them."""
        found = []
        for rank, seconds in enumerate(times):
            others = times[:rank] + times[rank + 1:]
            median = statistics.median(others) if others else 0.0
            ratio = seconds / median if median > 0 else 1.0
            if ratio > self.ratio:
                self.runs[rank] += 1
                self.ratios[rank] += ratio
            else:
                self.runs[rank], self.ratios[rank] = 0, 0.0
            if self.runs[rank] >= self.patience and rank not in self.named:
                self.named.add(rank)
                found.append((rank, self.ratios[rank] / self.runs[rank]))
        return found


def straggler_line(rank: int, host: str, ratio: float, patience: int = PATIENCE) -> str:
    """The log line naming a straggler."""
    return (f"straggler: rank {rank} ({host}) took {ratio:.1f}x the median step time of the other ranks for {patience} "
            f"steps in a row (its own work before the step's reduction; look at that host's load, clocks and "
            f"devices)")
