"""The loss ``ParallelModel.train_step`` returns: its backward has run, and calling it again says so.

``train_step`` runs the forward and the backward of every micro-batch itself (a pipeline schedule interleaves them,
and a ZeRO-3 layout frees each gathered layer as its backward ends), then returns the step's loss detached. A plain
loop's habit, ``loss.backward()`` next, would meet torch's "element 0 of tensors does not require grad and does not
have a grad_fn", which names neither the cause nor the next call; this tensor's ``backward`` names both. It is the
same number in every other respect: arithmetic on it gives plain tensors, ``item()``, formatting, saving and the
collectives take it as any tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.base.config import ConfigError

ALREADY = ("train_step has run this loss's backward already (the gradients are in .grad, summed over the layout by "
           "the optimizer step); call the optimizer step next (OptimizerStep(pmodel.grad_sync, optimizer)(loss)), not "
           "loss.backward()")


class StepLoss(torch.Tensor):
    """A step's detached loss whose ``backward`` raises ``ConfigError`` naming the next call (module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops on it give plain tensors

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(ALREADY)

    def __repr__(self, **kwargs: Any) -> str:  # printed as the tensor it is
        return self.as_subclass(torch.Tensor).__repr__(**kwargs)

    def __format__(self, spec: str) -> str:  # torch formats plain scalar tensors only (``type(self) is Tensor``)
        return self.item().__format__(spec) if self.dim() == 0 else super().__format__(spec)

    def __reduce_ex__(self, protocol: int) -> Any:  # saved (torch.save, pickle) as the plain tensor it holds
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def step_loss(loss: torch.Tensor) -> StepLoss:
    """``loss`` (detached) as a ``StepLoss``, sharing its storage."""
    return loss.as_subclass(StepLoss)
