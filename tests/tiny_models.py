"""Tiny transformers configs for tests: small enough for a 2-core CI, shaped to exercise every TP path
(vocab not divisible by tp -> padding; kv heads < tp -> replication; GPT2 -> Conv1D + fused qkv + ties)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig


def tiny_config(arch: str, **overrides) -> PretrainedConfig:
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    elif arch == "mistral":
        cfg = MistralConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                            sliding_window=6)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
