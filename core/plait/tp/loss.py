"""Vocab-parallel cross-entropy: the loss over logits split by vocabulary, without gathering them.

Each rank holds logits for vocab rows [vocab_start, vocab_start + V_local). Three all-reduces of one
number per token (max, target logit, sum of exponentials) give the exact softmax cross-entropy; the
backward pass is local (softmax - one_hot). With the whole vocabulary on one rank it is torch's own
cross-entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait import comm

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
) -> torch.Tensor:
    """Causal-LM loss as in transformers (labels shifted left, -100 ignored, computed in at least fp32).

    logits: [batch, seq, V_local] for this rank's vocab slice; labels: [batch, seq] full-vocab ids.
    ``shift=False``: the labels are already aligned with the logits (context parallelism shifts them on the
    whole sequence before cutting it).
    Returns the sum over tokens divided by ``num_items_in_batch`` when given (so that data-parallel ranks
    and accumulation steps can be summed exactly), else the mean over non-ignored tokens.
    """
    # at least fp32 (bf16 logits are upcast, as transformers does); float64 stays float64
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    shift_logits = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    shift_labels = labels.reshape(-1)
    if comm.group_size(group) == 1:  # whole vocabulary here: torch's fused kernel is faster
        total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        total = _VocabParallelCrossEntropy.apply(shift_logits, shift_labels, vocab_start, group).sum()
    if num_items_in_batch is None:
        num_items_in_batch = (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / num_items_in_batch
