"""All-to-all (Ulysses) attention: trade the sequence split for a head split, attend, trade back.

Each cp rank holds every head of its part of the sequence. One all-to-all per tensor gives it a C-th of the
heads over the whole sequence; the model's own attention function then runs on them with the whole
sequence's mask (transformers' mask, materialised for the model's implementation), so any mask, soft-cap,
sink or attention variant the model has is computed by the model's own code. A second all-to-all returns
the output to the sequence split. Key/value heads are repeated where there are fewer than C of them (or
their number does not divide by C), as TP does with kv heads fewer than its ranks.

Communication per attention call: 3 all-to-alls of q, k, v forward (each moving (C-1)/C of the tensor) and
1 of the output; backward the same, reversed.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from plait.base import comm
from plait.cp.masks import SequenceMask
from plait.cp.sequence import local_index, natural_order


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all`` whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return comm.all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return comm.all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many copies of each key/value head make their number divisible by a cp group of ``size``."""
    return size // math.gcd(kv_heads, size)


def inner_attention(module: nn.Module, implementation: str) -> Any:
    """The attention function ``module`` would call under ``implementation`` (its modeling file's own
    ``eager_attention_forward`` for eager, as transformers' modules look it up)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


@contextlib.contextmanager
def _kv_groups(module: nn.Module, groups: int) -> Iterator[None]:
    """Temporarily set how many query heads share a kv head (attention functions read it off the module)."""
    saved = getattr(module, "num_key_value_groups", None)
    if saved is None or saved == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = saved


def ulysses_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SequenceMask,
    implementation: str, **kwargs: Any,
) -> torch.Tensor:
    """Attention of this rank's [batch, heads, S/C, dim] slices over the whole sequence; returns
    [batch, S/C, heads, value dim] as transformers' attention functions do."""
    context = mask.context
    group, size, seq = context.cp.group, context.cp.size, context.seq
    heads, kv_heads = query.shape[1], key.shape[1]
    repeat = kv_repeats(kv_heads, size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    order = natural_order(seq, size, query.device)

    def to_heads(x: torch.Tensor) -> torch.Tensor:  # [b, H, S/C, d] -> [b, H/C, S, d] in sequence order
        return _AllToAll.apply(x, group, 1, 2).index_select(2, order)

    q, k, v = to_heads(query), to_heads(key), to_heads(value)
    if "position_ids" in kwargs:  # implementations that read positions (flash varlen) get the whole sequence's
        kwargs["position_ids"] = context.position_ids
    with _kv_groups(module, heads // (kv_heads * repeat)):
        out, _ = inner_attention(module, implementation)(module, q, k, v, mask.materialise(implementation), **kwargs)
    held = torch.cat([local_index(seq, size, r, query.device) for r in range(size)])
    # [b, S, H/C, dv] in sequence order -> rank order -> [b, S/C, H, dv]
    return _AllToAll.apply(out.index_select(1, held).contiguous(), group, 1, 2)
