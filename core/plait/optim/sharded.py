"""The optimizer of a ZeRO-2/3 model (``plait.fsdp``): any torch optimizer, stepping each parameter's local rows.

FSDP2's parameters are DTensors whose local rows are this rank's 1/dp of each tp/pp shard. Stepping those rows as
plain tensors (views of FSDP2's own storage, so the next gather sees the update) keeps the optimizer state plain
tensors of the same rows: a checkpoint saves them, like the parameters, as boxes of the logical tensors
(``ShardSpec.rows``), so any layout reads them back. With ``mixed_precision`` the rows are fp32 and are the
master weights: the optimizer state is fp32 and nothing else is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.checkpoint.state import LocalTensor, ReadOp, param_name, torch_load_plan, torch_optimizer_state
from plait.fsdp import local
from plait.grad_sync import grad_of, zero_grads

if TYPE_CHECKING:
    from plait.checkpoint.format import TensorEntry
    from plait.tp.sharding import ShardSpec


class ShardedOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer_class`` on the local rows of the (DTensor) parameters it is given.

    ``param_groups`` and ``state`` are the inner optimizer's (LR schedulers work on it), keyed by the rows.
    """

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], **defaults: Any) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.model_params: list[nn.Parameter] = []
        row_groups = []
        for group in groups:
            self.model_params += group["params"]
            row_groups.append({**group, "params": [local(p).detach() for p in group["params"]]})
        super().__init__(row_groups, defaults)
        self.inner = optimizer_class(self.param_groups, **defaults)
        self.state = self.inner.state

    @property
    def rows(self) -> list[torch.Tensor]:
        return [r for group in self.param_groups for r in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for param, rows in zip(self.model_params, self.rows):
            rows.grad = grad_of(param)
        loss = self.inner.step(closure)
        for rows in self.rows:
            rows.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.model_params)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def plait_state(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec]
    ) -> tuple[list[LocalTensor], dict[str, Any]]:
        """The inner optimizer's state under the parameters' names (its tensors are laid out like the rows)."""
        return torch_optimizer_state(self.inner, self._row_names(names), specs)

    def plait_plan_load(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec], meta: dict[str, Any],
        entries: dict[str, TensorEntry],
    ) -> tuple[list[ReadOp], Callable[[], None]]:
        """Read the state of this rank's rows, whatever layout saved it."""
        reads, state_dict = torch_load_plan(self.inner, self._row_names(names), specs, meta, entries)
        return reads, lambda: self.load_state_dict(state_dict)

    def _row_names(self, names: dict[nn.Parameter, str]) -> dict[torch.Tensor, str]:
        return {rows: param_name(names, param, self) for param, rows in zip(self.model_params, self.rows)}
