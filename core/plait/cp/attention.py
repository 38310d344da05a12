"""plait's context-parallel attention implementation, and installing it on a model.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` and build masks
with ``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``; both are open registries. Registering
``plait_cp`` in each and pointing the model's config at it puts every attention call of the model through
``context_parallel_attention`` with a whole-sequence ``SequenceMask``, whatever the architecture, while the
model's own choice (eager, sdpa, ...) stays the implementation each strategy computes with.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from plait.cp.masks import SequenceMask, sequence_mask_interface, wrap_mask_builders
from plait.cp.ring import ring_attention
from plait.cp.ulysses import ulysses_attention

IMPLEMENTATION = "plait_cp"


def context_parallel_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function every layer of a cp model calls (transformers' attention-function signature)."""
    if not isinstance(attention_mask, SequenceMask):
        raise RuntimeError(
            f"{type(module).__module__}.{type(module).__name__} was handed a {type(attention_mask).__name__} "
            f"mask, not one plait built over the whole sequence: its model builds masks without "
            f"transformers.masking_utils, which context parallelism needs"
        )
    cp = attention_mask.context.cp
    if cp.strategy_for(attention_mask.seq) == "ring":
        return ring_attention(module, query, key, value, attention_mask, **kwargs), None
    return ulysses_attention(module, query, key, value, attention_mask, cp.implementation, **kwargs), None


def install_context_parallel(model: nn.Module) -> str:
    """Route every attention call and mask of ``model`` through plait's cp implementation; returns the
    implementation the model had (what the strategies compute with). The model's modules get their own copies
    of their configs, so another model sharing a config object (a reference copy) is left as it was."""
    AttentionInterface.register(IMPLEMENTATION, context_parallel_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sequence_mask_interface)
    wrap_mask_builders(model)
    implementation = model.config._attn_implementation or "eager"
    if implementation == IMPLEMENTATION:
        raise RuntimeError("context parallelism is already installed on this model")
    copies: dict[int, PretrainedConfig] = {}  # one copy per config object (TP may give a module its own)
    # the model's and its language model's configs: an image-text model's vision tower attends within each image,
    # whole on every cp rank, and its config (of another class) keeps its own attention
    text = type(model.config.get_text_config())
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, (type(model.config), text)):
            if id(config) not in copies:
                copies[id(config)] = _routed(config, text)
            module.config = copies[id(config)]
    return implementation


def _routed(config: PretrainedConfig, text: type) -> PretrainedConfig:
    """A copy of ``config`` attending through plait's cp implementation, with copies of its language-model
    sub-configs alike (a composite's mask reads its text config's), its other sub-configs (a vision tower's) left
    as they are: the setter would set them all, and a shallow copy shares them with the modules they configure."""
    routed = copy.copy(config)
    routed._attn_implementation_internal = IMPLEMENTATION
    for key in getattr(routed, "sub_configs", {}):
        sub = getattr(routed, key, None)
        if isinstance(sub, text):
            setattr(routed, key, _routed(sub, text))
    return routed


def _configs(config: PretrainedConfig) -> Iterator[PretrainedConfig]:
    """``config`` and its sub-configs, depth first."""
    yield config
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            yield from _configs(sub)


@contextlib.contextmanager
def whole_sequences(model: nn.Module, implementation: str) -> Iterator[None]:
    """Inside, ``model`` attends as it did before context parallelism (``implementation``) over whatever sequence it
    is given: what decoding uses, each cp rank running its rows' whole sequences (the mask builders pass through
    outside a cp forward already)."""
    configs = {id(c): c for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)
               for c in _configs(m.config) if c._attn_implementation == IMPLEMENTATION}
    for config in configs.values():
        config._attn_implementation_internal = implementation
    try:
        yield
    finally:
        for config in configs.values():
            config._attn_implementation_internal = IMPLEMENTATION
