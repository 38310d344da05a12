"""ZeRO-1 (Rajbhandari et al. 2020): each data-parallel rank keeps optimizer state for 1/dp of the
parameters.

Built on ``torch.distributed.optim.ZeroRedundancyOptimizer`` (docs/decisions.md D5: bit-exact against AdamW,
works on plait's plain-tensor TP shards): it partitions this rank's parameters over the dp group (whole
parameters, greedily by size, so the state per rank is 1/dp of the total to within one parameter), builds
the per-rank optimizer on its partition only (so with ``MasterWeightOptimizer`` the fp32 masters are
sharded too), and after the step broadcasts each partition from its owner. Parameters are whatever this
rank's ParallelModel holds (a tp shard, a pipeline stage), so the dp group from the mesh is all it needs.

What plait adds is the gradient reduction: once per optimizer step (never per micro-step), each gradient
is summed only into the rank that owns it (``reduce``, bucketed per owner) instead of all-reduced
everywhere. Only owners' gradients are exact afterwards; clipping and the step read only those.
Measured on gloo (184 MB, dp=2): reduce to owners 297 ms, all-reduce 287 ms, ``reduce_scatter_single``
726 ms; on NCCL a reduce moves half an all-reduce's bytes. The parameter broadcast after the step is
``ZeroRedundancyOptimizer``'s own (``dist.broadcast`` per parameter, 107 ms for the same bytes), so it is
the one collective ``plait.base.comm.count_collectives`` does not see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from plait.base import comm
from plait.checkpoint.state import (
    LocalTensor, ReadOp, hyperparameters, optimizer_state, plan_optimizer_load, to_json,
)
from plait.parallel.grad_sync import BUCKET_BYTES, buckets, flatten, grad_of, unflatten, zero_grads

if TYPE_CHECKING:
    from plait.checkpoint.format import TensorEntry
    from plait.tp.sharding import ShardSpec


class Zero1Optimizer(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over a dp group, plus ``reduce_gradients`` to the owning ranks."""

    def __init__(self, params: Any, optimizer_class: Any, group: dist.ProcessGroup, **defaults: Any) -> None:
        super().__init__(params, optimizer_class=optimizer_class, process_group=group, **defaults)
        partition = self._partition_parameters()  # [dp rank][param group] -> {"params": [...]}
        self.params_by_rank: list[list[nn.Parameter]] = [
            [p for group_ in groups for p in group_["params"]] for groups in partition
        ]

    def _verify_same_dense_param_type(self) -> None:
        """torch refuses parameters of different dtypes because its ``parameters_as_bucket_view`` packs them into
        one flat buffer per device; plait never asks for that, and the per-parameter broadcast after the step
        takes any dtype. So a model transformers keeps partly in fp32 under bf16 (DeepSeek-V3's router
        ``gate.weight``, ``_keep_in_fp32_modules_strict``) trains under ZeRO-1; sparse parameters stay refused."""
        sparse = [p for p in self._all_params if p.is_sparse]
        if sparse:
            raise ValueError(f"ZeRO-1 takes dense parameters only; got {len(sparse)} sparse ones")

    @property
    def owned_params(self) -> list[nn.Parameter]:
        """The parameters this rank updates (and holds optimizer state for)."""
        return self.params_by_rank[self.rank]

    @torch.no_grad()
    def reduce_gradients(self, bucket_bytes: int = BUCKET_BYTES, reduce_dtype: torch.dtype | None = None) -> None:
        """Sum every gradient over the dp group into its owner, in flat buckets (one ``reduce`` each).

        ``reduce_dtype`` is the dtype on the wire (e.g. float32 for bf16 gradients); None keeps the
        gradients'. A parameter without a gradient on this rank contributes zeros, so every rank issues
        the same collectives.
        """
        for owner, params in enumerate(self.params_by_rank):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in params:
                grad = _grad_or_zeros(p)
                by_dtype.setdefault(reduce_dtype or grad.dtype, []).append(grad)
            for dtype, grads in by_dtype.items():
                for bucket in buckets(grads, bucket_bytes):
                    flat = comm.reduce(flatten(bucket, dtype), owner, self.process_group)
                    if owner == self.rank:
                        unflatten(flat, bucket)

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(p for group in self.param_groups for p in group["params"])

    def plait_state(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec]
    ) -> tuple[list[LocalTensor], dict[str, Any]]:
        """The state of the parameters this rank owns, saved as the per-rank optimizer saves it (class "AdamW",
        not ZeRO): a checkpoint then loads into plain AdamW, or into ZeRO-1 at any dp size."""
        tensors, meta = optimizer_state(self.optim, names, specs)
        # The outer groups are the ones LR schedulers change; the inner ones catch up only at the next step.
        meta["groups"] = [to_json(hyperparameters(group)) for group in self.param_groups]
        return tensors, meta

    def plait_plan_load(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec], meta: dict[str, Any],
        entries: dict[str, TensorEntry],
    ) -> tuple[list[ReadOp], Callable[[], None]]:
        """Read the state of the parameters this rank owns at this layout (whatever partition saved it)."""
        reads, finish_inner = plan_optimizer_load(self.optim, names, specs, meta, entries)

        def finish() -> None:
            finish_inner()
            for outer, inner in zip(self.param_groups, self.optim.param_groups):
                outer.update(hyperparameters(inner))  # LR schedulers use the outer groups

        return reads, finish


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    """The gradient of ``param``; zeros (stored as its ``.grad``) when backward gave it none."""
    grad = grad_of(param)
    if grad is None:
        param.grad = grad = torch.zeros_like(param)
    return grad
