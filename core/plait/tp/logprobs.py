"""What a training method's objective reads from one micro-batch's logits, on every layout.

Next-token training needs only the summed cross-entropy (``plait.tp.loss``). Other methods need more: DPO the summed
log-probability of each completion, distillation the whole distribution over the vocabulary. ``Logits`` hands an
objective this rank's logits with what reading them exactly takes: the labels aligned with them, which rows of the
``train_step`` batch they are, the vocabulary slice (tensor parallelism) and the sequence slice (context
parallelism) this rank holds. ``label_logps`` is the vocab-parallel cross-entropy per token, negated (no vocabulary
is gathered); ``sequence_sum`` sums per row over the whole sequence, across the cp ranks, with a backward that hands
every cp rank the gradient of the whole sum; ``log_softmax`` and ``vocab_sum`` give the full-vocabulary distribution
a divergence needs, still without gathering the vocabulary. An objective computes from these its share of the
step's loss: the shares of every micro-batch and of the dp x cp ranks sum to the loss (a term computed from
``sequence_sum`` is the same on each cp rank, so it divides by ``cp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.base import comm
from plait.base.mesh import Mesh
from plait.tp import mappings
from plait.tp.loss import IGNORE_INDEX, CausalLMLoss, _flat_upcast, _VocabParallelCrossEntropy, shift_labels


class _SumOverGroup(torch.autograd.Function):
    """The sum of a tensor over a group's ranks; its gradient is the sum of theirs (each rank's loss term depends on
    the whole sum, so each rank's part gets every rank's gradient of it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return comm.all_reduce(tensor.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_reduce(grad.clone(), ctx.group), None


@dataclass(frozen=True)
class Logits:
    """One micro-batch's logits on this rank: ``values`` [rows, seq, vocab slice], ``labels`` aligned with them
    ([rows, seq]: the label of each position's next token, ``IGNORE_INDEX`` where none), ``rows`` [rows] the
    micro-batch's rows in the batch ``train_step`` was given; the vocabulary slice starts at ``vocab_start`` of
    ``tp_group``'s; under cp the sequence is this rank's slice of ``cp`` (``cp_group``)."""

    values: torch.Tensor
    labels: torch.Tensor
    rows: torch.Tensor
    vocab_start: int = 0
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    cp: int = 1

    def label_logps(self) -> torch.Tensor:
        """log p(label) per position [rows, seq], in at least fp32; 0 where the label is ignored."""
        flat, labels = _flat_upcast(self.values), self.labels.reshape(-1)
        if comm.group_size(self.tp_group) == 1:
            loss = F.cross_entropy(flat, labels, ignore_index=IGNORE_INDEX, reduction="none")
        else:
            loss = _VocabParallelCrossEntropy.apply(flat, labels, self.vocab_start, self.tp_group)
        return -loss.view(self.labels.shape)

    def log_softmax(self, values: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """log-probs over the whole vocabulary of this rank's slice of ``values`` (default: these logits; a teacher's
        logits sliced alike), divided by ``temperature`` first, in at least fp32 [rows, seq, vocab slice]. Under tp
        the normaliser is summed over the ranks' slices; its gradient reaches each rank's own logits exactly."""
        z = (self.values if values is None else values)
        z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature
        if comm.group_size(self.tp_group) == 1:
            return F.log_softmax(z, dim=-1)
        peak = comm.all_reduce(z.detach().amax(dim=-1), self.tp_group, op="max")  # a constant: cancels in the result
        # every rank's log-probs read the normaliser, so its gradient is the sum of theirs (not vocab_sum's identity)
        total = _SumOverGroup.apply((z - peak.unsqueeze(-1)).exp().sum(dim=-1), self.tp_group)
        return z - (total.log() + peak).unsqueeze(-1)

    def vocab_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [rows, seq, vocab slice] summed over the whole vocabulary [rows, seq], the same on every tp rank,
        for a loss every tp rank computes alike from it (forward all-reduce, backward identity: each rank's slice gets
        the gradient of the whole sum, which every rank holds)."""
        return mappings.reduce_from_tp(values.sum(dim=-1), self.tp_group)

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [rows, seq] summed per row over the whole sequence (every cp rank's slice) [rows]."""
        partial = values.sum(dim=-1)
        return partial if self.cp == 1 else _SumOverGroup.apply(partial, self.cp_group)


# An objective: this rank's share of the step's loss from one micro-batch's logits (ParallelModel.train_step).
Objective = Callable[[Logits], torch.Tensor]


def read_logits(values: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, loss: CausalLMLoss,
                mesh: Mesh) -> Logits:
    """``Logits`` of one micro-batch: ``labels`` as the model was given them (shifted here, unless context
    parallelism shifted them on the whole sequence already), the vocabulary slice of ``loss``, the cp group of
    ``mesh``."""
    aligned = shift_labels(labels) if loss.shift else labels
    return Logits(values, aligned, rows, loss.vocab_start, loss.group, mesh.cp_group, mesh.cp)
