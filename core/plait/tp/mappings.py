"""The Megatron mappings (Shoeybi et al. 2019, Korthikanti et al. 2022) as tiny autograd functions.

Tensor parallelism is these operators placed at region boundaries; everything else composes them:
- ``copy_to_tp``          f: identity forward, all-reduce backward (entering a column-parallel region)
- ``reduce_from_tp``      g: all-reduce forward, identity backward (leaving a row-parallel region)
- ``scatter_to_seq``      split along the sequence (``SEQ_DIM``) forward, all-gather backward (entering SP)
- ``gather_from_seq``     all-gather forward; backward reduce-scatter when the consumer's gradient is a
                          partial sum over tp (column-parallel consumer), else split (replicated consumer)
- ``reduce_scatter_to_seq`` reduce-scatter forward, all-gather backward (row-parallel output under SP)
- ``keep_seq_shard``      split along the sequence forward, zero-padded backward (leaving a computation every
                          rank ran whole: each rank's gradient covers its own shard; the partial sums are added
                          where the computation entered, by ``gather_from_seq``'s reduce-scatter)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.base import comm

Group = dist.ProcessGroup | None
# The token dimension: transformers keeps activations as [batch, sequence, hidden] (dim 1), and some layers flatten
# them to [tokens, hidden] inside (OPT's MLP: ``hidden_states.reshape(-1, hidden)`` before fc1), where it is dim 0.
# Both are the dimension before hidden. A flattened shard [batch * seq/tp, hidden] is gathered rank by rank, an
# order only token-wise layers may see: the row-parallel layer after them reduce-scatters it back the same way.
SEQ_DIM = -2


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        if x.is_contiguous():
            # summed in place: said so, or autograd takes the sum for a view of the input and refuses the model's own
            # in-place ops on it (Falcon's ``mlp_output += attention_output``)
            ctx.mark_dirty(x)
            return comm.all_reduce(x, group)
        return comm.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather(grad, ctx.group, SEQ_DIM), None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, grad_is_partial: bool) -> torch.Tensor:
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return comm.all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grad_is_partial:
            return comm.reduce_scatter(grad, ctx.group, SEQ_DIM), None, None
        return comm.split(grad, ctx.group, SEQ_DIM), None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        # contiguous, as the residual stream is in one process: elementwise ops keep a strided layout, and model
        # code views it later (Beam's MoE: hidden_states.view(-1, hidden) after sandwich norms and a residual add)
        return comm.reduce_scatter(x, group, SEQ_DIM).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather(grad, ctx.group, SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if not comm.trivial(group) else x


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if not comm.trivial(group) else x


def scatter_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ScatterToSeq.apply(x, group) if not comm.trivial(group) else x


def gather_from_seq(x: torch.Tensor, group: Group, grad_is_partial: bool) -> torch.Tensor:
    return _GatherFromSeq.apply(x, group, grad_is_partial) if not comm.trivial(group) else x


def reduce_scatter_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceScatterToSeq.apply(x, group) if not comm.trivial(group) else x


class _KeepSeqShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.length = group, x.shape[SEQ_DIM]
        return comm.split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape = list(grad.shape)
        shape[SEQ_DIM] = ctx.length
        full = grad.new_zeros(shape)
        full.narrow(SEQ_DIM, comm.group_rank(ctx.group) * grad.shape[SEQ_DIM], grad.shape[SEQ_DIM]).copy_(grad)
        return full, None


def keep_seq_shard(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _KeepSeqShard.apply(x, group) if not comm.trivial(group) else x
