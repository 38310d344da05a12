"""One rank's part of a cp group: cutting batches, and running a forward with the whole sequence at hand.

The trainer hands every rank of a cp group the same whole sequences; ``ContextParallel`` keeps this rank's
slices (plait.cp.sequence explains the split) and, while the model runs on them, makes the whole sequence's
position ids and padding mask the current ``SequenceContext`` that the mask builders read (plait.cp.masks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from plait.cp.layout import CPPlan
from plait.cp.sequence import SequenceContext, enter, leave, local_index
from plait.tp.loss import shift_labels


class ContextParallel:
    """One rank's part of a cp group: cuts batches and runs forwards with the whole sequence at hand.

    ``plan``: the strategies that apply (plait.cp.layout.CPPlan); ``implementation``: the attention
    implementation the model had (eager, sdpa, ...), which the strategies compute with.
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, plan: CPPlan, implementation: str) -> None:
        self.group, self.size, self.rank = group, plan.size, rank
        self.plan, self.implementation = plan, implementation

    def strategy_for(self, seq: int) -> str:
        return self.plan.strategy_for(seq)

    def shard_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the labels, shifted first (position t holds the label of token t+1)."""
        return self.take(shift_labels(labels))

    def take(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of ``tensor`` along its sequence dimension ``dim``."""
        return tensor.index_select(dim, local_index(tensor.shape[dim], self.size, self.rank, tensor.device))

    @contextlib.contextmanager
    def forward(
        self, batch: int, seq: int, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
        device: torch.device,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Run one forward over a batch of whole sequences (``seq`` tokens): yields the model's inputs of this
        rank (its slices of the position ids and padding mask) while the whole ones are the current context."""
        if position_ids is None:  # the local slice needs its true positions, so they are always passed
            position_ids = torch.arange(seq, device=device).expand(batch, seq)
        context = SequenceContext(position_ids, attention_mask, self)
        token = enter(context)
        try:
            local = {"position_ids": self.take(position_ids)}
            if attention_mask is not None:
                local["attention_mask"] = self.take(attention_mask)
            yield local
        finally:
            leave(token)
