"""What a built rank actually holds, for checking the estimates against (tests and bench/plan_check.py)."""

from __future__ import annotations

import torch
from torch import nn

from plait.optim.mixed_precision import MasterWeightOptimizer
from plait.optim.zero import Zero1Optimizer
from plait.parallel.fsdp import local
from plait.parallel.grad_sync import grad_of


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank stores (under ZeRO-3 its rows of each)."""
    return sum(local(p).numel() * p.element_size() for p in module.parameters())


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of the gradients plait reduces and steps on (``main_grad`` buffers where they exist)."""
    grads = [grad_of(p) for p in module.parameters()]
    return sum(g.numel() * g.element_size() for g in grads if g is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor the optimizer holds, and of its master weights."""
    inner = optimizer.optim if isinstance(optimizer, Zero1Optimizer) else optimizer
    total = sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
                if isinstance(t, torch.Tensor))
    if isinstance(inner, MasterWeightOptimizer):
        total += sum(m.numel() * m.element_size() for m in inner.masters)
    return total
