"""Replicas start equal: the weights a model holds when it is laid out are global rank 0's on every rank.

Every rank holding a copy of a weight must start from the same values, or data parallelism trains replicas that
never agree: their gradients are averaged, but different weights stay different. A user who builds the model on
each rank with a different seed (or none) would get exactly that, silently. So ``parallelize`` broadcasts the
parameters and buffers of a model that holds them from global rank 0 before anything splits them, as torch's
DistributedDataParallel broadcasts its module's state at construction: the ranks then lay out one model. Tensors on
the meta device are skipped: their values come later from one source (``materialize`` reads the same files on every
rank, or seeds each parameter by its name), and a meta model costs nothing here.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.parallel.grad_sync import BUCKET_BYTES, buckets, flatten, unflatten


def held_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers that hold values (not on the meta device), each once (tied weights are
    one tensor), in the model's own order: the same list on every rank of a model built from one config."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def broadcast_from_first(model: nn.Module, group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Overwrite every held tensor of ``model`` with the first rank of ``group``'s, in flat buckets per dtype (on
    the group's device: a CPU model under NCCL travels through the accelerator). Returns the bytes broadcast (0 in a
    trivial group)."""
    if comm.trivial(group):
        return 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for tensor in held_tensors(model):
        by_dtype[tensor.dtype].append(tensor.data)
    wire = comm.device_for(group)
    sent = 0
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            for bucket in buckets(by_dtype[dtype], bucket_bytes):
                flat = flatten(bucket, dtype).to(wire)
                comm.broadcast(flat, group, src=0)
                unflatten(flat, bucket)
                sent += flat.numel() * flat.element_size()
    return sent
