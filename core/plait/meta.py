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


def causal_lm_refusal(config: PretrainedConfig) -> str | None:
    """Why ``config`` cannot be a decoder-only transformers causal LM (None: it can), in one line: an
    encoder-decoder model, an encoder-only one (BERT and its kin, which transformers maps to a masked LM: its
    causal-LM head runs only with is_decoder=true), or a type AutoModelForCausalLM does not build. The trainer's check and
    the generic adapter's refusals both ask here."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if getattr(config, "is_encoder_decoder", False) or getattr(config_class, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model; plait trains decoder-only causal LMs"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return (f"{model_type} is an encoder-only model (its causal-LM head runs only with is_decoder=true in the "
                f"config); plait trains decoder-only causal LMs")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"transformers has no causal-LM class for {model_type!r} (AutoModelForCausalLM does not build it); "
                f"plait trains decoder-only causal LMs")
    return None


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers causal LM of ``config`` on the meta device."""
    with meta_init():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
