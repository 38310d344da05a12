"""Gradient reductions after backward: sums over the groups that share a parameter.

Coalesced into flat buckets so a model with hundreds of small parameters issues a handful of collectives.
A parameter whose gradients are accumulated in a higher-precision buffer (``main_grad``, set up by
``plait.optim.mixed_precision``) is reduced through that buffer: ``grad_of`` is the one place that knows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from plait import comm

BUCKET_BYTES = 32 * 1024 * 1024
MAIN_GRAD = "main_grad"  # Megatron's name for a gradient kept apart from ``param.grad`` (e.g. in fp32)


def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient plait reduces, clips and steps on: ``param.main_grad`` when the parameter has one."""
    if hasattr(param, MAIN_GRAD):
        return getattr(param, MAIN_GRAD)
    return param.grad


def zero_grads(params: Iterable[nn.Parameter]) -> None:
    """Drop ``grad`` and zero ``main_grad`` buffers so the next step starts from nothing."""
    for p in params:
        p.grad = None
        if hasattr(p, MAIN_GRAD):
            getattr(p, MAIN_GRAD).zero_()


def sum_grads(
    params: list[nn.Parameter], group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group`` in flat buckets per dtype.

    ``reduce_dtype`` (e.g. float32 for bf16 gradients) is the dtype on the wire; None keeps each gradient's.
    """
    if comm.trivial(group):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        grad = grad_of(p)
        if grad is not None:
            by_dtype[reduce_dtype or grad.dtype].append(grad)
    for dtype, grads in by_dtype.items():
        for bucket in buckets(grads, bucket_bytes):
            flat = flatten(bucket, dtype)
            comm.all_reduce(flat, group)
            unflatten(flat, bucket)


def buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` of at least ``bucket_bytes`` each (the last may be smaller)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        bucket.append(t)
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into ``tensors`` (casting to each one's dtype)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
