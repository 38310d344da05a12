"""Gradient reductions after backward: sums over the groups that share a parameter.

Coalesced into flat buckets so a model with hundreds of small parameters issues a handful of collectives.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from plait import comm

BUCKET_BYTES = 32 * 1024 * 1024


def sum_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group`` in flat buckets per dtype."""
    if comm.group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_dtype[p.grad.dtype].append(p.grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= bucket_bytes:
                _reduce_bucket(bucket, group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group)


def _reduce_bucket(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
