"""An optimizer step on gradients the layout has not summed yet is refused, whoever built the optimizer.

After ``train_step`` each rank holds its own part of the gradients: each data-parallel replica's from its own rows,
the partial gradients of parameters the tensor-parallel ranks share (sequence-parallel norms, row-parallel biases),
each pipeline end's half of a tied embedding. ``OptimizerStep`` (or ``grad_sync.finish()``) sums them; a plain
``optimizer.step()`` straight after ``train_step`` stepped every rank on its part alone, and the copies of a weight
drifted apart without a word (an audit at dp=2: the replicas differed from step 1). torch runs its global
optimizer pre-step hooks for every optimizer, so the refusal also reaches one the user built and stepped themselves;
it costs a look at a set of pending sums, empty whenever the step comes after the sums, as it should.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from plait.base.config import ConfigError

FIX = ("call pmodel.grad_sync.finish() before optimizer.step(), or step with OptimizerStep(pmodel.grad_sync, "
       "optimizer, max_grad_norm)(pmodel.global_loss(loss)), which also clips by the global norm (docs/own-loop.md)")

_waiting: weakref.WeakSet = weakref.WeakSet()  # the GradSyncs whose last train_step's gradients are not summed
_hooked = False


class Pending:
    """The sums a layout's gradients need before a step, and which of them a ``train_step`` left undone.

    ``needed``: the sums' descriptions by name (``model_parallel``, ``data_parallel``); none at one process, or
    where the layout sums on its own (ZeRO-2/3's FSDP2 reduce-scatters over the replicas during backward).
    ``params``: the ids of the parameters whose optimizer's step is checked.
    """

    def __init__(self, needed: dict[str, str], params: list[torch.nn.Parameter]) -> None:
        global _hooked
        self.needed, self.left = needed, set()
        self.params = {id(p) for p in params}
        if needed and not _hooked:
            register_optimizer_step_pre_hook(_refuse_unsummed)
            _hooked = True

    def gradients_written(self) -> None:
        """A ``train_step`` ran (or started): every sum is owed again."""
        if self.needed:
            self.left = set(self.needed)
            _waiting.add(self)

    def done(self, *names: str) -> None:
        """``names`` are summed (every one when none is given)."""
        self.left = self.left - set(names) if names else set()
        if not self.left:
            _waiting.discard(self)

    def message(self) -> str:
        owed = " and ".join(self.needed[name] for name in self.needed if name in self.left)
        return (f"optimizer.step() on gradients not yet summed {owed}: each rank would step on its own part and the "
                f"copies of a weight drift apart silently; {FIX}")


def _refuse_unsummed(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global pre-step hook: refuse a step of an optimizer holding parameters whose sums are owed."""
    waiting = list(_waiting)
    if not waiting:  # every train_step's sums done: the step as it should come
        return
    held = {id(t) for group in optimizer.param_groups for t in group["params"]}
    held |= {id(t) for t in getattr(optimizer, "model_params", [])}  # plait's stand-ins (fp32 masters, FSDP2 rows)
    for pending in waiting:
        if not held.isdisjoint(pending.params):
            raise ConfigError(pending.message())
