"""Dropout randomness under tensor and sequence parallelism: the right stream in every region.

Every rank draws dropout masks from torch's default generator, seeded alike on every rank (``--seed``).
That is right for activations replicated over the tp group (each rank must drop the same elements, or the
ranks silently diverge) and wrong for activations each rank holds a different part of: local attention
heads, sequence shards under SP. Those would all get one mask pattern. Megatron-LM and NeuronX Distributed
keep two generators for this; plait forks one stream per tp rank off the shared one:

* ``distinct()`` draws one number from the shared CPU stream (so the shared stream advances alike on every
  rank), seeds the default CPU and accelerator generators from it and the tp rank, runs the region, and
  restores the shared state. A mask is a function of (seed, rank coordinates, step), so exact resume, which
  restores the shared state, holds; activation checkpointing restores the shared state before recomputing,
  so a recomputed region draws the same masks again.
* Regions: under SP, every decoder layer (sequence shards between the TP regions, head and feature shards
  inside them); without SP, every attention block (local heads), where the row-parallel output projection
  hands back to the shared stream (``resume_shared``): its output, and a residual dropout on it, are whole
  and equal on every rank. Dropout before the SP region (GPT2's embedding dropout) uses the shared stream.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct ranks get well-separated seeds


class DropoutRNG:
    """The per-tp-rank stream of one rank, forked off the shared default generator region by region."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._saved: tuple[torch.Tensor, Any, torch.device] | None = None  # shared state while in a region
        self._resumed = False

    @contextlib.contextmanager
    def distinct(self, device: torch.device) -> Iterator[None]:
        """Run the body on this rank's own stream (nested calls join the outer region)."""
        if self._saved is not None:
            yield
            return
        draw = int(torch.randint(0, 2**62, (1,)).item())  # from the shared CPU stream: alike on every rank
        self._saved, self._resumed = (torch.get_rng_state(), _accelerator_state(device), device), False
        seed = (draw + _GOLDEN * (self.tp_rank + 1)) % 2**63
        torch.default_generator.manual_seed(seed)
        if device.type != "cpu":
            torch.get_device_module(device.type).manual_seed(seed)
        try:
            yield
        finally:
            if not self._resumed:
                _restore(*self._saved)
            self._saved = None

    @contextlib.contextmanager
    def shared(self, device: torch.device) -> Iterator[None]:
        """Run the body on the shared stream, also inside a region (a replicated activation there: LoRA's input
        of a column-parallel base), which then goes on with this rank's stream where it was."""
        if self._saved is None or self._resumed:
            yield
            return
        own = (torch.get_rng_state(), _accelerator_state(device), device)
        _restore(*self._saved)
        try:
            yield
        finally:
            self._saved = (torch.get_rng_state(), _accelerator_state(device), device)  # the shared stream moved on
            _restore(*own)

    def resume_shared(self) -> None:
        """Back to the shared stream for the rest of the region: what follows is equal on every rank."""
        if self._saved is not None and not self._resumed:
            _restore(*self._saved)
            self._resumed = True


def _accelerator_state(device: torch.device) -> Any:
    return torch.get_device_module(device.type).get_rng_state() if device.type != "cpu" else None


def _restore(cpu_state: torch.Tensor, accelerator_state: Any, device: torch.device) -> None:
    torch.set_rng_state(cpu_state)
    if accelerator_state is not None:
        torch.get_device_module(device.type).set_rng_state(accelerator_state)


def _in_region(forward: Callable[..., Any], rng: DropoutRNG, module: nn.Module) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        device = next(module.parameters()).device
        with rng.distinct(device):
            return forward(*args, **kwargs)

    return run


def install_dropout_rng(
    model: nn.Module, tp_rank: int, region_modules: list[str], shared_after: list[str]
) -> DropoutRNG:
    """Run each module of ``region_modules`` on this rank's stream, handing back to the shared stream after
    each of ``shared_after`` (row-parallel layers whose output is whole again). Wraps ``forward`` in place,
    so parameter names do not change; apply it before activation checkpointing wraps the same modules."""
    rng = DropoutRNG(tp_rank)
    for name in region_modules:
        module = model.get_submodule(name)
        module.forward = _in_region(module.forward, rng, module)
    for name in shared_after:
        model.get_submodule(name).register_forward_hook(lambda *_: rng.resume_shared())
    return rng
