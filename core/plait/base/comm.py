"""Every collective plait issues goes through these few functions.

Keeping them in one place makes communication countable (``CommCounter``, used by bench/tp_comm.py) and
keeps the backend open: only torch.distributed calls appear here, so gloo, NCCL and XLA all work. A group of
None (single process) or of one rank makes each function the identity.

``PLAIT_SINGLETON_GROUPS=1`` (read at each call, not at import: a rank forked from a preloaded server
sets its environment after importing) turns that shortcut off for real groups of one rank, and the mesh
then builds such groups: a one-GPU NCCL world passes every collective call site real device tensors. It is a
testing aid for backends that cannot put two ranks on one device (NCCL refuses to).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.base.device import current_device

_counters: list["CommCounter"] = []


def singleton_groups() -> bool:
    """Whether groups of one rank are real groups (``PLAIT_SINGLETON_GROUPS=1``): collectives then run on them."""
    return os.environ.get("PLAIT_SINGLETON_GROUPS") == "1"


@dataclass
class CommCounter:
    """Records (op, bytes sent into the collective per rank) for every collective while active."""

    records: list[tuple[str, int]] = field(default_factory=list)

    def total(self, op: str | None = None) -> int:
        return sum(n for o, n in self.records if op is None or o == op)

    def count(self, op: str | None = None) -> int:
        return sum(1 for o, _ in self.records if op is None or o == op)


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounter]:
    counter = CommCounter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _record(op: str, tensor: torch.Tensor) -> None:
    for counter in _counters:
        counter.records.append((op, tensor.numel() * tensor.element_size()))


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def trivial(group: dist.ProcessGroup | None) -> bool:
    """Whether collectives on ``group`` are the identity (no group, or one rank unless singleton_groups())."""
    return group is None or (not singleton_groups() and dist.get_world_size(group) == 1)


def device_for(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor made on the host (a metric, a flag) must live for a collective on ``group``: the CPU
    when the group's backend takes CPU tensors (gloo), else the current accelerator (NCCL: the rank's GPU)."""
    if trivial(group) or "gloo" in dist.get_backend(group):
        return torch.device("cpu")
    return current_device()


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce; returns ``tensor``."""
    if trivial(group):
        return tensor
    _record("all_reduce", tensor)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return tensor


def reduce(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ranks into group rank ``dst`` (in place there; other ranks' buffers are scratch).

    ZeRO-1 reduces each gradient to the one rank that updates it: on gloo this costs what an all-reduce
    does (measured: 297 vs 287 ms for 184 MB), where ``reduce_scatter_single`` took 726 ms.
    """
    if trivial(group):
        return tensor
    _record("reduce", tensor)
    dist.reduce(tensor, group_dst=dst, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
    size = group_size(group)
    if trivial(group):
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    _record("all_gather", moved)
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's chunk along ``dim``."""
    size = group_size(group)
    if trivial(group):
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    _record("reduce_scatter", moved)
    dist.reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``tensor`` into group-size chunks along ``scatter_dim``, send chunk j to rank j, and concatenate
    what every rank sent here along ``gather_dim`` (rank order): one all-to-all of equal splits."""
    size = group_size(group)
    if trivial(group):
        return tensor
    send = torch.stack(tensor.chunk(size, dim=scatter_dim)).contiguous()  # [size, ...chunk]
    recv = torch.empty_like(send)
    _record("all_to_all", send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def all_to_all_rows(tensor: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send rows of ``tensor`` (dim 0) to the ranks of ``group`` in consecutive blocks of ``send[j]`` rows to rank
    j, and return the ``recv[i]`` rows each rank i sent here, in rank order: one all-to-all of variable splits
    (expert parallelism's dispatch)."""
    if trivial(group):
        return tensor
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    _record("all_to_all", tensor)
    dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=group)
    return out


def ring_shift(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> Callable[[], list[torch.Tensor]]:
    """Start sending ``tensors`` to the next rank of ``group`` and receiving the previous rank's; returns the
    wait that gives the received tensors. All exchanges are posted at once (no rank waits on its neighbour's
    order) and run while the caller computes (ring attention overlaps each block's transfer with the last)."""
    if trivial(group):
        return lambda: tensors
    rank, size = group_rank(group), group_size(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = []
    for t, r in zip(tensors, received):
        _record("send", t)
        ops += [dist.P2POp(dist.isend, t.contiguous(), nxt, group), dist.P2POp(dist.irecv, r, prev, group)]
    works = dist.batch_isend_irecv(ops)

    def wait() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return received

    return wait


def broadcast(tensor: torch.Tensor, group: dist.ProcessGroup | None, src: int) -> torch.Tensor:
    """In-place broadcast from the rank whose position in ``group`` is ``src``; returns ``tensor``."""
    if trivial(group):
        return tensor
    _record("broadcast", tensor)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    return tensor


def split(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """This rank's chunk along ``dim``; no communication."""
    size = group_size(group)
    if size == 1:
        return tensor
    return tensor.chunk(size, dim=dim)[group_rank(group)].contiguous()


def world_group() -> dist.ProcessGroup | None:
    """The group of every rank, or None in a single process (so the functions here become the identity)."""
    if dist.is_available() and dist.is_initialized() and (dist.get_world_size() > 1 or singleton_groups()):
        return dist.group.WORLD
    return None


def all_gather_object(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's picklable ``obj`` in group-rank order (checkpoint metadata, errors); ``[obj]`` alone."""
    size = group_size(group)
    if trivial(group):
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: dist.ProcessGroup | None) -> None:
    if not trivial(group):
        dist.barrier(group=group)
