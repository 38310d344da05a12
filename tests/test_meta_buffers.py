"""Buffers a meta build leaves empty are recomputed by transformers' own ``_init_weights``, or named in an error:
GPT-Neo's boolean causal masks (a global and a local one) as much as a rotary ``inv_freq``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPTNeoConfig

from plait.base.config import ConfigError
from plait.base.meta import build_meta_model
from plait.checkpoint.materialize import materialize_buffers


def test_boolean_masks_of_gpt_neo_are_rebuilt_exactly():
    config = GPTNeoConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                          attention_types=[[["global", "local"], 1]], window_size=6)
    meta = build_meta_model(config)
    materialize_buffers(meta, torch.device("cpu"))
    real = AutoModelForCausalLM.from_config(config)
    for name, buffer in real.named_buffers():
        rebuilt = meta.get_buffer(name)
        assert rebuilt.dtype == buffer.dtype and torch.equal(rebuilt, buffer), name
    local = meta.get_buffer("transformer.h.1.attn.attention.bias")
    assert not local[0, 0, 10, 0] and local[0, 0, 10, 5]  # the local layer's window is kept, not the global mask


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_a_buffer_init_weights_does_not_recompute_is_named(dtype):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Module()
            self.inner.register_buffer("mask", torch.ones(3, dtype=dtype, device="meta"), persistent=False)

        def _init_weights(self, module: nn.Module) -> None:  # recomputes nothing
            pass

    with pytest.raises(ConfigError, match=r"buffers \['inner.mask'\] were not recomputed after the meta build"):
        materialize_buffers(Model(), torch.device("cpu"))
