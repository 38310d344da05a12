"""ZeRO-1 under expert parallelism: dense and expert parameters sharded over their own replica groups.

ZeroRedundancyOptimizer assumes every rank of its group holds the same parameters; under ep the ranks of the
replica group (dp x cp) hold different experts. So the dense parameters get a ``Zero1Optimizer`` over the
replica group and the expert parameters one over the expert-replica group (dp x cp / ep ranks holding the same
experts; a plain optimizer when that group is one rank), as Megatron's distributed optimizer keeps an
expert-data-parallel buffer. Both parts are built with the same parameter groups (a part may hold none of a
group's parameters), so the checkpoint describes one optimizer with the groups a run without ep has, and
loads into any layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.base import comm
from plait.checkpoint.state import ReadOp, merge_optimizer_meta, optimizer_state, plan_optimizer_load
from plait.optim.zero import Zero1Optimizer
from plait.parallel.grad_sync import BUCKET_BYTES, sum_grads

if TYPE_CHECKING:
    import torch.distributed as dist

    from plait.checkpoint.format import TensorEntry
    from plait.checkpoint.state import LocalTensor
    from plait.tp.sharding import ShardSpec


class ExpertZero1Optimizer(torch.optim.Optimizer):
    """Two optimizers stepped as one: ``dense`` (ZeRO-1 over dp x cp) and ``experts`` (ZeRO-1 over the
    expert-replica group, or plain). ``param_groups`` are the dense part's, as many as a run without ep has (so
    an LR scheduler's state moves between layouts); their hyperparameters reach the expert part's groups at each
    step, as ZeroRedundancyOptimizer's outer groups reach its inner optimizer."""

    def __init__(self, groups: list[dict[str, Any]], is_expert: Callable[[nn.Parameter], bool], constructor: Any,
                 replica_group: dist.ProcessGroup, expert_group: dist.ProcessGroup | None, **defaults: Any) -> None:
        part = lambda keep: [{**g, "params": [p for p in g["params"] if keep(p)]} for g in groups]  # noqa: E731
        self.dense = Zero1Optimizer(part(lambda p: not is_expert(p)), constructor, replica_group, **defaults)
        expert_groups = part(is_expert)
        self.expert_group = expert_group
        self.sharded = not comm.trivial(expert_group)
        self.experts = (Zero1Optimizer(expert_groups, constructor, expert_group, **defaults) if self.sharded
                        else constructor(expert_groups, **defaults))
        self.defaults = self.dense.defaults
        self.state = {}  # each part keeps its own; checkpoints go through plait_state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.dense.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        pass  # torch.optim.Optimizer.__init__ is not called: the parts own the groups

    @property
    def owned_params(self) -> list[nn.Parameter]:
        """The parameters this rank updates: its dense partition and its experts' partition (or all its experts)."""
        experts = (self.experts.owned_params if self.sharded
                   else [p for g in self.experts.param_groups for p in g["params"]])
        return self.dense.owned_params + experts

    @torch.no_grad()
    def reduce_gradients(self, bucket_bytes: int = BUCKET_BYTES, reduce_dtype: torch.dtype | None = None) -> None:
        self.dense.reduce_gradients(bucket_bytes, reduce_dtype)
        if self.sharded:
            self.experts.reduce_gradients(bucket_bytes, reduce_dtype)
        else:  # no other rank holds these experts
            sum_grads([p for g in self.experts.param_groups for p in g["params"]], self.expert_group, bucket_bytes,
                      reduce_dtype)

    def step(self, closure: Any = None) -> Any:
        self._sync_groups()
        self.experts.step()
        return self.dense.step(closure)

    def _sync_groups(self) -> None:
        for dense, experts in zip(self.dense.param_groups, self.experts.param_groups):
            experts.update({key: value for key, value in dense.items() if key != "params"})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)

    def plait_state(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec]
    ) -> tuple[list[LocalTensor], dict[str, Any]]:
        """Both parts' state as one optimizer's (the groups are the same in both)."""
        dense, dense_meta = optimizer_state(self.dense, names, specs)
        experts, expert_meta = optimizer_state(self.experts, names, specs)
        return dense + experts, merge_optimizer_meta([dense_meta, expert_meta])

    def plait_plan_load(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec], meta: dict[str, Any],
        entries: dict[str, TensorEntry],
    ) -> tuple[list[ReadOp], Callable[[], None]]:
        dense_reads, finish_dense = plan_optimizer_load(self.dense, names, specs, meta, entries)
        expert_reads, finish_experts = plan_optimizer_load(self.experts, names, specs, meta, entries)

        def finish() -> None:
            finish_dense()
            finish_experts()
            self._sync_groups()

        return dense_reads + expert_reads, finish
