"""LoRA's update of a parameter stacked over experts, as peft's ``ParamWrapper`` makes it (``target_parameters``).

transformers' routed experts hold ``gate_up_proj`` [E, 2I, H] (or ``up_proj``) and ``down_proj`` [E, H, I], each
[E, out, in], or [E, in, out] when the module ``is_transposed``. peft adapts such a parameter with A [r * E, in]
(expert-major: expert e's rows are e*r ... e*r + r-1) and B [out, r * E] (rank-major: expert e's columns are e,
E + e, ...), and while the module runs it reads ``W_e + scale * B_e @ A_e`` for every expert e in place of the
parameter. The update is of the weight, not of an activation: the experts kernel (grouped_mm, eager, ...) runs
unchanged on it, and a rank's slices of W, A and B (``lora/layout.py``: tp's intermediate split, ep's experts) give
its slice of the update with no communication.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.lora import switch


def updated(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, transposed: bool) -> torch.Tensor:
    """``weight`` plus ``scale * B_e @ A_e`` for each of its experts (as many as ``weight.shape[0]``; A and B in
    peft's layout for them): one ``baddbmm`` in the weight's dtype, autocast off, as peft folds it
    (``_LoraFactorsProxy``)."""
    experts = weight.shape[0]
    a = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
    lhs, rhs = (a.transpose(-2, -1), b.transpose(-2, -1)) if transposed else (b, a)
    with torch.autocast(weight.device.type, enabled=False):
        return torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=scale)


def install(module: nn.Module, factors: dict[str, nn.Module], scale: float) -> None:
    """Make ``module`` run with each parameter named in ``factors`` (its holder of ``lora_A`` and ``lora_B``)
    replaced by its update, read afresh at every call (resume and ``materialize`` swap tensors in). The
    parameters themselves stay registered under their names, so tp, ep, checkpoints and the optimizer see the
    module as without LoRA; the update is only what the forward (and its recomputation) reads."""
    inner = module.forward  # transformers' dispatch to its kernel, or ep's dispatch around it
    transposed = getattr(module, "is_transposed", False)  # peft reads the layout from the same attribute

    def forward(*args, **kwargs):
        if not switch.active():
            return inner(*args, **kwargs)
        frozen = {leaf: module._parameters[leaf] for leaf in factors}
        try:
            for leaf, holder in factors.items():  # torch.func.functional_call's swap, without re-entering hooks
                module._parameters[leaf] = updated(frozen[leaf], holder.lora_A.weight, holder.lora_B.weight, scale,
                                                   transposed)
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(frozen)

    module.forward = forward
