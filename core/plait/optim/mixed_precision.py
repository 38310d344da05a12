"""Mixed precision for training: fp32 master weights for low-precision parameters and fp32 gradient
accumulation across micro-steps.

Two ways to train in bf16, as in optimum-neuron and Megatron:
- bf16 parameters (half the parameter and activation memory) with the optimizer stepping fp32 copies
  ("master weights") and keeping its state in fp32; the bf16 parameters are refreshed from the masters after
  every step. Updates far below bf16's resolution (lr * Adam's unit-sized step ~ 1e-4 of a weight ~ 1)
  would otherwise round to nothing.
- fp32 parameters with ``torch.autocast(dtype=bfloat16)`` around the forward pass (``--bf16_autocast``,
  applied by ``plait.parallelize``): matmuls run in bf16, everything stored is fp32.
Gradients of bf16 parameters summed over many micro-steps lose the same low bits, so each backward's
gradient is added into an fp32 ``main_grad`` buffer (optimum-neuron's ``use_grad_acc_hook``) and the bf16
``.grad`` is freed at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.checkpoint.format import CheckpointError, spec_boxes
from plait.checkpoint.state import (
    LocalTensor, ReadOp, local_views, optimizer_key, torch_load_plan, torch_optimizer_state,
)
from plait.optim.stand_ins import StandInOptimizer
from plait.parallel.grad_sync import MAIN_GRAD, MAIN_GRAD_STALE

if TYPE_CHECKING:
    from plait.checkpoint.format import TensorEntry
    from plait.tp.sharding import ShardSpec


def accumulate_grads_in(params: Iterable[nn.Parameter], dtype: torch.dtype) -> list[Any]:
    """Accumulate each backward's gradient of ``params`` into a ``dtype`` buffer ``param.main_grad``.

    The buffers live as long as the parameters (as in Megatron), so a gradient's dtype is known on every
    rank before any backward. Uses post-accumulate-grad hooks, which fire once per backward per parameter
    (tied parameters included) after autograd has summed every use. Returns the hook handles.
    """
    handles = []
    for param in params:
        setattr(param, MAIN_GRAD, torch.zeros_like(param, dtype=dtype))
        handles.append(param.register_post_accumulate_grad_hook(_accumulate))
    return handles


def _accumulate(param: nn.Parameter) -> None:
    buffer = getattr(param, MAIN_GRAD)
    if getattr(param, MAIN_GRAD_STALE, False):  # the step's first gradient: copied, not added to zeros
        buffer.copy_(param.grad)
        setattr(param, MAIN_GRAD_STALE, False)
    else:
        buffer.add_(param.grad)
    param.grad = None


class MasterWeightOptimizer(StandInOptimizer):
    """Runs any torch optimizer on ``dtype`` copies of the parameters it is given.

    ``step`` hands each parameter's gradient (``grad_of``: the fp32 ``main_grad`` when accumulating in fp32)
    to its master, steps the inner optimizer, and copies the masters back into the parameters. The masters
    and every state tensor the inner optimizer creates are in ``dtype``. ``param_groups`` and ``state`` are
    the inner optimizer's, so LR schedulers and state dicts work as on the inner optimizer; the state dict
    also carries the masters (``master_weights``), which bf16 parameters cannot give back exactly.
    Under ZeRO-1 this is the per-rank optimizer ``ZeroRedundancyOptimizer`` builds, so the masters exist only
    for the rank's own partition.
    """

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], dtype: torch.dtype,
                 **defaults: Any) -> None:
        self.dtype = dtype
        super().__init__(params, optimizer_class, lambda p: p.detach().to(dtype, copy=True), **defaults)

    @property
    def masters(self) -> list[torch.Tensor]:
        return self.stand_ins

    def after_step(self) -> None:
        torch._foreach_copy_(self.model_params, self.masters)  # one multi-tensor copy (and cast), not one per tensor

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        state["master_weights"] = [m.clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for param, master, saved in zip(self.model_params, self.masters, masters):
                master.copy_(saved)
                param.copy_(master)

    def plait_state(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec]
    ) -> tuple[list[LocalTensor], dict[str, Any]]:
        """The inner optimizer's state under the parameters' names, plus the masters as
        ``optimizer/<param>/master`` (sharded like their parameters): bf16 parameters cannot give them back."""
        master_names = self.stand_in_names(names)
        tensors, meta = torch_optimizer_state(self.inner, master_names, specs)
        for master in self.masters:
            spec = specs[master_names[master]]
            tensors.append(LocalTensor(optimizer_key(master_names[master], "master"), "optim", spec.full_shape,
                                       master, spec_boxes(spec)))
        return tensors, meta

    def plait_plan_load(
        self, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec], meta: dict[str, Any],
        entries: dict[str, TensorEntry],
    ) -> tuple[list[ReadOp], Callable[[], None]]:
        """Read the inner optimizer's state and the saved masters; from a checkpoint without masters (saved with
        fp32 parameters), the loaded parameters become the masters."""
        master_names = self.stand_in_names(names)
        reads, state_dict = torch_load_plan(self.inner, master_names, specs, meta, entries)
        saved = []
        for master in self.masters:
            logical = optimizer_key(master_names[master], "master")
            if logical in entries:
                saved.append(torch.zeros(master.shape, dtype=master.dtype))
                reads += local_views(specs[master_names[master]], saved[-1], logical)
        if saved and len(saved) != len(self.masters):
            raise CheckpointError(f"checkpoint has master weights for {len(saved)} of {len(self.masters)} parameters")

        def finish() -> None:
            masters = saved or [param.detach().to(self.dtype) for param in self.model_params]
            self.load_state_dict({**state_dict, "master_weights": masters})

        return reads, finish
