"""Gradient reductions after backward: sums over the groups that share a parameter.

``GradSync`` is the one object that knows, for a laid-out model, which gradients are summed over which
group and which gradients this rank counts in the global norm; the optimizer step drives it. Reductions are
coalesced into flat buckets so a model with hundreds of small parameters issues a handful of collectives.
A parameter whose gradients are accumulated in a higher-precision buffer (``main_grad``, set up by
``plait.optim.mixed_precision``) is reduced through that buffer: ``grad_of`` is the one place that knows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.base.mesh import Mesh
from plait.parallel.fsdp import local
from plait.parallel.unsummed import Pending
from plait.tp.sharding import Part

BUCKET_BYTES = 32 * 1024 * 1024
MAIN_GRAD = "main_grad"  # Megatron's name for a gradient kept apart from ``param.grad`` (e.g. in fp32)


MAIN_GRAD_STALE = "main_grad_stale"  # the buffer still holds the last step's sum: it counts as zero


def grads_of(params: Iterable[nn.Parameter], parts: dict[int, Part] | None = None) -> list[torch.Tensor]:
    """The gradients of ``params`` that exist (``grad_of``), each cut to its ``parts`` entry where it has one."""
    found = []
    for p in params:
        grad = grad_of(p)
        if grad is not None:
            part = parts.get(id(p)) if parts else None
            found += part.views(grad) if part is not None else [grad]
    return found


def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient plait reduces, clips and steps on: ``param.main_grad`` when the parameter has one.

    A buffer no backward has written since ``zero_grads`` is zeroed here, on first read: only parameters that
    got no gradient in a step (unrouted experts, say) pay for a zeroing pass. Under ZeRO-2/3 (FSDP2) it is the
    local rows of the sharded gradient.
    """
    if not hasattr(param, MAIN_GRAD):
        return local(param.grad) if param.grad is not None else None
    buffer = getattr(param, MAIN_GRAD)
    if getattr(param, MAIN_GRAD_STALE, False):
        buffer.zero_()
        setattr(param, MAIN_GRAD_STALE, False)
    return buffer


def zero_grads(params: Iterable[nn.Parameter]) -> None:
    """Drop ``grad`` and mark ``main_grad`` buffers stale, so the next step starts from nothing.

    Marking rather than zeroing: the step's first backward then copies its gradient into the buffer instead of
    adding it to zeros (``optim.mixed_precision``), which saves writing and reading the whole fp32 buffer once
    a step (about 2% of a 1B model's step on an H100, bench/gpu.py).
    """
    for p in params:
        p.grad = None
        if hasattr(p, MAIN_GRAD):
            setattr(p, MAIN_GRAD_STALE, True)


def sum_grads(
    params: list[nn.Parameter], group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES,
    reduce_dtype: torch.dtype | None = None, parts: dict[int, Part] | None = None,
) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group`` in flat buckets per dtype.

    ``reduce_dtype`` (e.g. float32 for bf16 gradients) is the dtype on the wire; None keeps each gradient's.
    ``parts``: for some parameters (by id), the part of the gradient to sum; the rest is left as it is.
    """
    if comm.trivial(group):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for grad in grads_of(params, parts):
        by_dtype[reduce_dtype or grad.dtype].append(grad)
    for dtype, grads in by_dtype.items():
        for bucket in buckets(grads, bucket_bytes):
            flat = flatten(bucket, dtype)
            comm.all_reduce(flat, group)
            unflatten(flat, bucket)


def sum_copies(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """``sum_grads`` over copies of parameters that several ranks hold (tied weights, every-stage modules,
    Zamba2's shared block). A copy its rank's forward never used has no gradient: it counts as zeros where another
    rank's copy has one (so every rank flattens the same tensors), and stays None where none has (the optimizer
    then skips it, as it would on one process)."""
    if comm.trivial(group) or not params:
        return
    zeros_where_used_elsewhere(params, group)
    sum_grads(params, group)


def zeros_where_used_elsewhere(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Give a parameter without a gradient on this rank zeros where another rank of ``group`` has one, so that
    every rank flattens the same tensors (one small all-reduce of a flag per parameter)."""
    if comm.trivial(group) or not params:
        return
    used = torch.tensor([float(grad_of(p) is not None) for p in params], device=params[0].device)
    comm.all_reduce(used, group)
    for param, count in zip(params, used.tolist()):
        if count and grad_of(param) is None:
            param.grad = torch.zeros_like(param)


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


class GradSync:
    """Gradient sums of one rank of a laid-out model, and the parameters its share of the grad norm covers.

    ``shared``: parameters replicated over a tp group (or a block of it) whose gradients each rank computes
    only in part (sequence-parallel norms, row-parallel biases, kv heads shared by several ranks), by group.
    ``tied``: the copies of a weight held by the first and last pipeline stage (tied embeddings), summed over
    ``ends_group``. ``replicated``: parameters every pipeline stage holds (``PipelinePlan.every_stage``: Gemma's
    per-layer embeddings), each stage's gradient covering its own layers, summed over the pipeline group.
    ``norm_params``: the gradients this rank adds to the global norm (see ``norm_params``).
    ``experts``: parameters of this rank's experts under expert parallelism, held by the expert-replica group
    (dp x cp / ep ranks) only: their gradients are summed there, and the other ep ranks hold other experts.
    ``shared_parts`` / ``norm_parts``: for parameters (by id) of which only a part is shared, or counted here (a
    fused qkv with a replicated kv head), that part (``Part``); the others are whole.
    """

    def __init__(
        self, mesh: Mesh, params: list[nn.Parameter], shared: dict[Any, list[nn.Parameter]],
        tied: list[nn.Parameter], ends_group: Any, norm_params: list[nn.Parameter],
        experts: list[nn.Parameter] | None = None, replicated: list[nn.Parameter] | None = None,
        shared_parts: dict[int, Part] | None = None, norm_parts: dict[int, Part] | None = None,
    ) -> None:
        self.mesh, self.params, self.shared, self.tied = mesh, params, shared, tied
        self.replicated = replicated or []
        self.ends_group, self.norm_params = ends_group, norm_params
        self.shared_parts, self.norm_parts = shared_parts or {}, norm_parts or {}
        self.experts = experts or []
        self._expert_ids = {id(p) for p in self.experts}
        # an image-text model's vision tower has no gradient on a replica whose rows hold no image: the replicas
        # then agree which gradients exist before summing them (one more small all-reduce a step)
        self.sometimes_unused = False
        self.pending = Pending(self._needed(), params)  # the sums a train_step's gradients owe before a step

    def _needed(self) -> dict[str, str]:
        """What ``model_parallel`` and ``data_parallel`` sum in this layout, in words (``unsummed.Pending``)."""
        mesh, parts = self.mesh, []
        if any(params and not comm.trivial(group) for group, params in self.shared.items()):
            parts.append(f"over the tensor-parallel ranks that share a parameter (tp={mesh.tp})")
        if self.tied and not comm.trivial(self.ends_group):
            parts.append("of the tied weight's copies on the first and last pipeline stage")
        if self.replicated and not comm.trivial(mesh.pp_group):
            parts.append("of the weights every pipeline stage holds")
        needed = {"model_parallel": " and ".join(parts)} if parts else {}
        replicas = not comm.trivial(mesh.replica_group) or (
            self.experts and not comm.trivial(mesh.expert_replica_group))
        if replicas and not mesh.config.fsdp:  # FSDP2 reduce-scatters over the replicas during backward
            needed["data_parallel"] = f"over the data-parallel replicas (dp={mesh.dp}" + (
                f", cp={mesh.cp})" if mesh.cp > 1 else ")")
        return needed

    def is_expert(self, param: nn.Parameter) -> bool:
        return id(param) in self._expert_ids

    def model_parallel(self) -> None:
        """Sum partial gradients over the tp groups that share parameters, the tied copies over the two
        pipeline ends and the replicated ones over the pipeline (so every copy takes identical steps)."""
        for group, params in self.shared.items():
            sum_grads(params, group, parts=self.shared_parts)
        if self.tied:
            sum_copies(self.tied, self.ends_group)
        if self.replicated:
            sum_copies(self.replicated, self.mesh.pp_group)
        self.pending.done("model_parallel")

    def data_parallel(
        self, params: list[nn.Parameter] | None = None, bucket_bytes: int = BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        """All-reduce ``params`` (default: every trainable parameter) over the replica group (dp x cp), expert
        parameters over the expert-replica group."""
        params = self.params if params is None else params
        dense = [p for p in params if not self.is_expert(p)]
        if self.sometimes_unused:  # an image-text model's vision tower, idle on a replica without images
            zeros_where_used_elsewhere(dense, self.mesh.replica_group)
        sum_grads(dense, self.mesh.replica_group, bucket_bytes, reduce_dtype)
        experts = [p for p in params if self.is_expert(p)]
        if experts:
            sum_grads(experts, self.mesh.expert_replica_group, bucket_bytes, reduce_dtype)
        self.pending.done("data_parallel")

    def finish(self) -> None:
        """Both: what a plain (non-ZeRO) optimizer needs before its step."""
        self.model_parallel()
        self.data_parallel()


def norm_params(
    named_params: Iterable[tuple[str, nn.Parameter]], specs_by_rank: list[dict[str, Any]], tp_rank: int,
    skip: Iterable[nn.Parameter] = (),
) -> tuple[list[nn.Parameter], dict[str, Part]]:
    """The parameters whose gradients this rank counts in the global gradient norm, and for those it counts in
    part, by name, the part (spans of the local tensor's split dim).

    Every distinct slice of every logical parameter is counted on exactly one rank of the tp group: a
    tp-sharded slice on its rank, a replicated parameter (or a kv head shared by a block of ranks, whose
    ShardSpec is then equal across the block) on the first rank holding that same slice; a split tensor's ranges
    (a fused qkv's q, k and v rows) each so. ``skip``: second copies counted elsewhere (a tied embedding held by
    the last stage is counted on the first). Summing the squares over tp (and pp, and dp for the slices each dp
    rank updates) gives the single-process norm.
    """
    skipped = {id(p) for p in skip}
    counted, parts = [], {}
    for name, param in named_params:
        spec = specs_by_rank[tp_rank][name]
        earlier = [specs_by_rank[r][name] for r in range(tp_rank)]
        if id(param) in skipped or any(s == spec for s in earlier):
            continue
        counted.append(param)
        if spec is not None and spec.dim is not None and len(spec.ranges) > 1 and earlier:
            held = {(s.dim, r) for s in earlier if s is not None for r in s.ranges}
            own = tuple(i for i, r in enumerate(spec.ranges) if (spec.dim, r) not in held)
            if len(own) < len(spec.ranges):
                parts[name] = Part(spec.dim, spec.local_spans(own))
    return counted, parts
