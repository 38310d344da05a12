"""Models on the meta device: a transformers model's structure and shapes without its memory.

Used to build a model no rank holds whole (``plait.materialize``, like optimum-neuron's
``lazy_load_for_parallelism`` and NxD's meta init) and to know a config's parameter names and shapes
without allocating them (``plait consolidate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Every tensor created inside is a meta tensor."""
    with torch.device("meta"):
        yield


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers causal LM of ``config`` on the meta device."""
    with meta_init():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
