"""Routed tokens to their experts' ranks and back: the all-to-all around transformers' own experts kernel.

An experts module's ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` is replaced on
each ep rank by: sort this rank's T * k (token, expert) pairs by expert, which groups them by the ep rank
holding that expert; exchange the per-expert counts (one small all-to-all); send each pair's hidden vector to
its expert's rank (an all-to-all of variable splits); run the module's own forward there, through whatever
experts implementation transformers is configured with (``grouped_mm``: one grouped matrix multiply per
projection; ``eager``; ...) on the received rows with routing weight 1; send the outputs back with the reverse
all-to-all, and weight and sum them per token exactly as transformers does (``proj_out * weight``, summed over
the k choices). Backward is the same two all-to-alls reversed. The router, its top-k, group limits, bias
correction and shared experts all run unchanged on the token's own rank, so routing is the model's own.

With ``capacity_factor`` a rank sends each expert at most ceil(factor * T * k / E) pairs (the first in token
order), as Megatron's per-rank capacity does; the others contribute zero and are counted in ``dropped``.

Experts that take another contract, expert-major (``ExpertMajorParallel``: Llama 4's ``forward(hidden_states
[E * T, H])``, every expert on every token, its MoE block having weighted each copy by its routing score, zero where
the expert was not chosen), get each of their blocks of T rows on the rank holding that expert, run there on every
source rank's tokens at once, and are sent back: the same all-to-all, of whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.base.training_forward import is_training_forward


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent in ``send`` counts to the ranks of ``group``, ``recv`` counts received; backward
    sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_to_all_rows(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


class ExpertParallel:
    """Installs expert parallelism on one experts module whose parameters already hold this rank's experts
    (``num_experts`` local ones of ``total`` over the ep ``group``)."""

    def __init__(self, group: dist.ProcessGroup, total: int, capacity_factor: float | None = None) -> None:
        self.group, self.total, self.capacity_factor = group, total, capacity_factor
        self.size = comm.group_size(group)
        self.local = total // self.size
        self.dropped = 0  # (token, expert) pairs dropped by the capacity since the last read
        self._kernel: Callable[..., torch.Tensor] | None = None
        self._module: nn.Module | None = None

    def install(self, module: nn.Module) -> None:
        self._kernel, self._module = module.forward, module  # transformers' dispatch to the configured kernel
        module.num_experts = self.local  # the kernels size their per-expert bins by it
        module.forward = self.forward

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args, **kwargs) -> torch.Tensor:
        tokens, k = top_k_index.shape
        shape, width = hidden_states.shape, hidden_states.shape[-1]
        hidden_states = hidden_states.reshape(-1, width)  # DBRX's experts take [batch, seq, hidden]: the same tokens
        pairs = top_k_index.reshape(-1)
        order = torch.argsort(pairs, stable=True)  # by expert, hence by the ep rank holding it
        counts = torch.bincount(pairs, minlength=self.total)
        if self.capacity_factor is not None:
            order, counts = self._cap(pairs, order, counts, tokens * k)
        received = comm.all_to_all(counts.view(self.size, self.local), self.group, 0, 0)  # [sources, local]
        send, recv = counts.view(self.size, self.local).sum(1).tolist(), received.sum(1).tolist()
        rows = _AllToAll.apply(hidden_states[order // k], send, recv, self.group)
        local_ids = torch.repeat_interleave(
            torch.arange(self.local, device=pairs.device).repeat(self.size), received.reshape(-1))
        if rows.shape[0]:
            ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
            out = self._kernel(rows, local_ids.unsqueeze(1), ones, *args, **kwargs).reshape(-1, width)
        else:  # nothing routed here: the experts still join backward (zero gradients), as on every other rank
            out = rows + sum(p.sum() * 0 for p in self._module.parameters())
        back = _AllToAll.apply(out, recv, send, self.group)
        per_pair = back.new_zeros((tokens * k, width)).index_copy(0, order, back)
        # shaped before the sum, not after: a view returned from an FSDP2 unit (ZeRO-2/3) is one whose in-place
        # change would skip the unit's pre-backward gather
        weighted = per_pair.view(*shape[:-1], k, width) * top_k_weights.view(*shape[:-1], k, 1)
        return weighted.sum(dim=-2).to(hidden_states.dtype)

    def _cap(self, pairs: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, n_pairs: int):
        """Keep at most the capacity of pairs per expert (the first in token order)."""
        capacity = math.ceil(self.capacity_factor * n_pairs / self.total)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(n_pairs, device=pairs.device) - starts[pairs[order]]
        keep = position < capacity
        kept = counts.clamp(max=capacity)
        if is_training_forward():  # not recomputation, evaluation or shape inference: once per training forward
            self.dropped += int(n_pairs - keep.sum())
        return order[keep], kept


class ExpertMajorParallel(ExpertParallel):
    """Expert parallelism for experts whose ``forward(hidden_states)`` takes T tokens for each of their experts in
    turn ([E * T, H], expert-major) and returns the same layout (module docstring): rank j's experts' blocks go to
    rank j, which runs its ``local`` experts on every ep rank's tokens (its module sees [local * sum(T), H]) and
    sends each rank's rows back, so every expert computes what it would in one process, on 1/ep of the experts."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        width = hidden_states.shape[-1]
        tokens = hidden_states.shape[0] // self.total
        counts = torch.full((self.size, 1), tokens, dtype=torch.long, device=hidden_states.device)
        sources = comm.all_to_all(counts, self.group, 0, 0).view(-1).tolist()  # each ep rank's T
        send, recv = [self.local * tokens] * self.size, [self.local * t for t in sources]
        rows = _AllToAll.apply(hidden_states.reshape(-1, width).contiguous(), send, recv, self.group)
        by_expert = torch.cat([part.view(self.local, t, width) for part, t in zip(rows.split(recv), sources)], dim=1)
        out = self._kernel(by_expert.reshape(-1, width), *args, **kwargs).view(self.local, sum(sources), width)
        back = torch.cat([part.reshape(-1, width) for part in out.split(sources, dim=1)])
        return _AllToAll.apply(back, recv, send, self.group)
