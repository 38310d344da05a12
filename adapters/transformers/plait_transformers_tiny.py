"""A tiny config of any transformers architecture, derived from its config class's defaults.

The conformance kit needs a model small enough for a 2-core CI that still exercises every path: 4 layers
(pp=2 with 2 virtual stages), 4 heads over 2 kv heads (GQA; kv-head replication at tp=4), a vocabulary tp
does not divide (padding), dropout and router jitter 0 (parity needs a deterministic forward), a sliding
window shorter than the test sequences, and each kind of layer the architecture alternates between. Sizes are
set only on the keys the class has; lists with one entry per layer are rebuilt for 4 layers.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

LAYERS, VOCAB = 4, 61
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "ffn_hidden_size": 64,
    "dense_intermediate_size": 64, "intermediate_size_mlp": 64, "max_position_embeddings": 64,
    "sliding_window": 6, "sliding_window_pattern": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4, "v_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 2, "attention_chunk_size": 8,
}
# Training-time randomness (dropout, router jitter) off: parity needs a deterministic forward.
NOISE_KEYS = ("dropout", "pdrop", "jitter")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Set even where the default is None (None there means "derive it", which the small sizes make explicit);
# elsewhere None switches a feature off (no sliding window, no q LoRA) and stays.
EXPLICIT = ("head_dim", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok")


def tiny_config(config_class: type[PretrainedConfig]) -> PretrainedConfig:
    """``config_class`` with test sizes on every key its defaults have (see the module docstring)."""
    defaults = config_class()
    values = defaults.to_dict()
    layers = values.get("num_hidden_layers")
    overrides = {k: v for k, v in SIZES.items() if k in values and (values[k] is not None or k in EXPLICIT)}
    if "qk_rope_head_dim" in values and "head_dim" in values:
        overrides["head_dim"] = SIZES["qk_rope_head_dim"]  # multi-head latent attention: head_dim is the rotary part
    for key, value in values.items():
        if isinstance(value, float) and not isinstance(value, bool) and any(k in key for k in NOISE_KEYS):
            overrides[key] = 0.0
        elif key in TOKEN_IDS and value is not None:
            overrides[key] = TOKEN_IDS[key]
        elif isinstance(value, list) and layers and len(value) == layers:
            overrides[key] = _per_layer(value)
    config = config_class(**{**values, **overrides})
    if hasattr(defaults, "tie_word_embeddings"):
        config.tie_word_embeddings = defaults.tie_word_embeddings
    return config


def _per_layer(value: list) -> list:
    """A 4-layer list with each distinct entry of ``value`` in the order it first appears, cycled
    (``[sliding] * 5 + [full]`` -> ``[sliding, full, sliding, full]``)."""
    distinct = list(dict.fromkeys(map(_hashable, value)))
    kinds = [value[[_hashable(v) for v in value].index(d)] for d in distinct]
    return [kinds[i % len(kinds)] for i in range(LAYERS)]


def _hashable(value: Any) -> Any:
    return repr(value) if isinstance(value, (list, dict)) else value
