"""Vocab-parallel cross-entropy: the loss over logits split by vocabulary, without gathering them.

Each rank holds logits for vocab rows [vocab_start, vocab_start + V_local). Three all-reduces of one
number per token (max, target logit, sum of exponentials) give the exact softmax cross-entropy; the
backward pass is local (softmax - one_hot). With the whole vocabulary on one rank it is torch's own
cross-entropy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.base import comm
from plait.base.batches import check_token_range

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
        logits_max = comm.all_reduce(logits.max(dim=-1).values, group, op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = torch.where(owned, local_target, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * owned
        target_logit = comm.all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group)
        valid = target != IGNORE_INDEX
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, owned, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift: bool = True,
    whole_vocab_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal-LM loss as in transformers (labels shifted left, -100 ignored, computed in at least fp32).

    logits: [batch, seq, V_local] for this rank's vocab slice; labels: [batch, seq] full-vocab ids.
    ``shift=False``: the labels are already aligned with the logits (context parallelism shifts them on the
    whole sequence before cutting it). Shifting moves the labels, never the logits (as transformers does): a
    slice of the logits would be copied whole in forward and again in backward (a 128k vocabulary makes that
    3% of a 1B model's step on an H100, bench/gpu.py).
    ``whole_vocab_sum``: replaces ``whole_vocab_loss_sum`` when this rank has the whole vocabulary (a compiled
    copy of it: ``CausalLMLoss.compile``).
    Returns the sum over tokens divided by ``num_items_in_batch`` when given (so that data-parallel ranks
    and accumulation steps can be summed exactly), else the mean over non-ignored tokens.
    """
    if shift:
        labels = shift_labels(labels)
    if comm.group_size(group) == 1:  # whole vocabulary here: torch's fused kernel is faster
        total = (whole_vocab_sum or whole_vocab_loss_sum)(logits, labels)
    else:
        total = _VocabParallelCrossEntropy.apply(_flat_upcast(logits), labels.reshape(-1), vocab_start, group).sum()
    if num_items_in_batch is None:
        num_items_in_batch = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / num_items_in_batch


def num_items_in_batch(labels: torch.Tensor) -> torch.Tensor:
    """The loss's divisor for a global batch's ``labels`` [rows, seq]: the tokens with a label after the causal shift
    (not each row's first position, nor -100). Every rank knows the global batch, so no collective is needed; passed
    to ``train_step`` on every rank, it makes the ranks' and micro-steps' losses sum to one process's."""
    return labelled_tokens(labels).sum()


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's tokens with a label after the causal shift [rows] (``num_items_in_batch`` per row)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t gets the label of token t+1, the last position an ignored one: the logits stay whole."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def whole_vocab_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of aligned ``logits`` [..., V] and ``labels`` [...], in at least fp32."""
    return F.cross_entropy(_flat_upcast(logits), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def _flat_upcast(logits: torch.Tensor) -> torch.Tensor:
    """[tokens, V] in at least fp32 (bf16 logits are upcast, as transformers does; float64 stays float64)."""
    return logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))


class CausalLMLoss:
    """The loss of one rank's logits: ``vocab_parallel_cross_entropy`` with this layout's vocab slice and group.

    One object is shared by the model's forward and its pipeline stages, so ``compile`` reaches both.
    """

    def __init__(self, vocab_start: int, group: dist.ProcessGroup | None, shift: bool = True, vocab_size: int = 0,
                 ) -> None:
        self.vocab_start, self.group, self.shift, self.vocab_size = vocab_start, group, shift, vocab_size
        self.whole_vocab_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.vocab_size and comm.group_size(self.group) > 1:  # split: a rank reads its own rows only
            check_token_range(self.vocab_size, labels=labels)
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.group, num_items_in_batch,
                                            self.shift, self.whole_vocab_sum)

    def compile(self, **options: Any) -> bool:
        """``torch.compile`` the whole-vocabulary loss (as torchtitan compiles its loss): the upcast, log-softmax
        and gather fuse into one pass over the logits, and backward's softmax minus one-hot into another.
        The vocab-parallel loss holds collectives and stays eager. ``options`` go to ``torch.compile``. Returns
        whether anything was compiled."""
        if comm.group_size(self.group) != 1:
            return False
        self.whole_vocab_sum = torch.compile(whole_vocab_loss_sum, **options)
        return True
