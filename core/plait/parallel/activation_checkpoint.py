"""Activation checkpointing of leaf modules: keep only each leaf's inputs, recompute its inside in backward.

The adapter's leaf modules (``plait_leaf_modules``: decoder layers) are the units, as in torchtitan and
optimum-neuron. It is applied after tensor parallelism so that recomputation replays the tp/sp collectives
inside a layer in the same order on every rank (non-reentrant ``torch.utils.checkpoint``, which also
restores the RNG state for dropout). The module's ``forward`` is wrapped in place rather than the module
being replaced by a wrapper, so parameter names (and with them shard specs, checkpoints and the optimizer)
do not change. ``TPRegionEntry`` stays correct: recomputed activations are new tensors, so its identity
cache misses on them and enters each once, like the original forward did; ``after`` (the entry's ``clear``) runs
when each leaf's forward or recomputation ends, so the last recomputed layer's entered input (under SP, a whole
gathered sequence) is not kept alive through the optimizer step until the next forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.base.patterns import leaf_module_names


def _checkpointed(forward: Callable[..., Any], after: Callable[[], None]) -> Callable[..., Any]:
    def forward_then(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        finally:
            after()

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward_then, *args, use_reentrant=False, **kwargs)

    return run


def checkpoint_targets(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of the modules matching one of ``patterns`` (pure: runs before any process group exists)."""
    return leaf_module_names(model, patterns, "gradient checkpointing")


def apply_activation_checkpointing(model: nn.Module, names: Sequence[str], after: Callable[[], None]) -> None:
    """Wrap the ``forward`` of each named module (from ``checkpoint_targets``) in a non-reentrant checkpoint;
    ``after`` runs when each forward or recomputation of one ends."""
    for name in names:
        module = model.get_submodule(name)
        module.forward = _checkpointed(module.forward, after)
