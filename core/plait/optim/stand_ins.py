"""Any torch optimizer stepping stand-ins for the model's parameters: the shared part of fp32 master weights
(``mixed_precision.MasterWeightOptimizer``: copies, written back after each step) and of ZeRO-2/3's local rows
(``sharded.ShardedOptimizer``: views of FSDP2's storage, nothing to write back).

The inner optimizer sees only the stand-ins, so its state (and a checkpoint of it) is laid out like them; the
parameters' names reach that state through ``stand_in_names``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.checkpoint.state import LocalTensor, ReadOp, param_name, torch_load_plan, torch_optimizer_state
from plait.parallel.grad_sync import grad_of, zero_grads

if TYPE_CHECKING:
    from plait.checkpoint.format import TensorEntry
    from plait.tp.sharding import ShardSpec


class StandInOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer_class`` on ``stand_in(p)`` for each parameter ``p`` it is given.

    ``step`` hands each parameter's gradient (``grad_of``: a ``main_grad`` buffer or a DTensor's local rows where
    there is one) to its stand-in in the stand-in's dtype, steps the inner optimizer and calls ``after_step``.
    ``param_groups`` and ``state`` are the inner optimizer's (LR schedulers and state dicts work as on it).
    """

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer],
                 stand_in: Callable[[nn.Parameter], torch.Tensor], **defaults: Any) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.model_params: list[nn.Parameter] = []
        stand_in_groups = []
        for group in groups:
            self.model_params += group["params"]
            stand_in_groups.append({**group, "params": [stand_in(p) for p in group["params"]]})
        super().__init__(stand_in_groups, defaults)
        # The inner optimizer completes and then shares these very group dicts (lr changes reach it).
        self.inner = optimizer_class(self.param_groups, **defaults)
        self.state = self.inner.state

    @property
    def stand_ins(self) -> list[torch.Tensor]:
        return [t for group in self.param_groups for t in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for param, stand_in in zip(self.model_params, self.stand_ins):
            grad = grad_of(param)
            stand_in.grad = None if grad is None else grad.to(stand_in.dtype)
        loss = self.inner.step(closure)
        self.after_step()
        for stand_in in self.stand_ins:
            stand_in.grad = None
        return loss

    def after_step(self) -> None:
        """What the stand-ins' update owes the parameters (nothing for views of their storage)."""

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
        """The inner optimizer's state under the parameters' names (its tensors are laid out like the stand-ins)."""
        return torch_optimizer_state(self.inner, self.stand_in_names(names), specs)

    def plait_plan_load(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec], meta: dict[str, Any],
        entries: dict[str, TensorEntry],
    ) -> tuple[list[ReadOp], Callable[[], None]]:
        """Read the inner optimizer's state for this rank's stand-ins, whatever layout saved it."""
        reads, state_dict = torch_load_plan(self.inner, self.stand_in_names(names), specs, meta, entries)
        return reads, lambda: self.load_state_dict(state_dict)

    def stand_in_names(self, names: dict[nn.Parameter, str]) -> dict[torch.Tensor, str]:
        """Each stand-in under its parameter's logical name."""
        return {stand_in: param_name(names, param, self) for param, stand_in in zip(self.model_params, self.stand_ins)}
