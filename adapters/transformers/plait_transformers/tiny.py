"""A tiny config of any transformers architecture, derived from its config class's defaults.

The conformance kit needs a model small enough for a 2-core CI that still exercises every path: 4 layers
(pp=2 with 2 virtual stages), 4 heads over 2 kv heads (GQA; kv-head replication at tp=4), a vocabulary tp
does not divide (padding), dropout and router jitter 0 (parity needs a deterministic forward), a sliding
window shorter than the test sequences, and each kind of layer the architecture alternates between. Sizes are
set only on the keys the class has (under its own names where its ``attribute_map`` renames them); lists with one entry per layer, per-layer overrides keyed by layer index
(``per_layer_config``), layer kinds placed by period and offset and counts of layers of one kind are rebuilt for
4 layers; a composite config's sub-configs are shrunk the same way. Sizes the class derives itself (a field whose
default is None, a value its init computes) it derives again from the test sizes. ARCHITECTURES holds the few
values a class's own defaults need to build a model that runs at all, each with why.
"""

from __future__ import annotations

import dataclasses
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
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "laurel_rank": 4, "index_n_heads": 4,
    "index_head_dim": 8, "mamba_n_heads": 4, "mamba_d_state": 8, "linear_num_heads": 4, "linear_head_dim": 8,
    "num_expert_group": 1, "num_experts_per_token": 2,
    "rotary_dim": 4, "d_head": 8, "d_inner": 64,  # GPT-J's rotary part of a head; XLNet's head and MLP widths
    "word_embed_proj_dim": 32,  # OPT's embedding width, projected to hidden_size where they differ (default: equal)
}
# Counts of layers of one kind (the last 15 of 35 share their kv cache, the first 2 are dense): scaled to 4 layers,
# at least one where the default has any.
LAYER_COUNTS = ("num_kv_shared_layers", "num_dense_layers")
# Training-time randomness (dropout, router jitter) off: parity needs a deterministic forward.
NOISE_KEYS = ("dropout", "pdrop", "jitter")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Set even where the default is None (None there means "derive it", which the small sizes make explicit);
# elsewhere None switches a feature off (no sliding window, no q LoRA) and stays.
EXPLICIT = ("head_dim", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok")
# A key a release adds under a prefix of its own beside the plain key (a second attention kind's
# ``swa_num_attention_heads`` and ``swa_head_dim``, ``unpadded_vocab_size``) is shrunk to the plain key's size, so
# that a new release's config still shrinks; never grown (``type_vocab_size`` 2 stays), and keys SIZES names
# itself keep their own sizes.
SUFFIXED = ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
# Where a class's own defaults do not build a model that runs (shrunk or not), the values that make them.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    # rope_parameters defaults to {}, but the rotary module reads one entry per layer type (M-RoPE sections)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 1, 1]}}},
    # n_shared_experts defaults to None, which the MoE block multiplies by
    "dots1": {"n_shared_experts": 1},
    # layer_types defaults to None, which every layer indexes: one short-conv and one attention layer, twice
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (LAYERS // 2)},
    # multi-head latent attention expanding keys for every head, whose attention still divides the heads by
    # num_key_value_heads (or whose class checks they are equal): the two must be equal
    **{arch: {"num_key_value_heads": SIZES["num_attention_heads"]} for arch in ("axk2", "deepseek_v32", "glm_moe_dsa")},
    # num_layers_per_stack is stored beside num_hidden_layers (stacks x cycles of it); None derives it again
    "hrm_text": {"num_layers_per_stack": None},
    # its attention reads attn_config.rope_theta, which the attention config class does not define (a checkpoint's
    # config.json carries it), and clamps q/k/v by clip_qkv, which defaults to None (clamp then raises): DBRX's
    # own values; kv_n_heads 2 of 4 heads: grouped-query, as SIZES has it elsewhere
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # layer kinds as [[kinds, repeats]] (expanded into attention_layers, which must have one per layer) and the local
    # layers' window under its own name
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]], "window_size": 6},
    # its own names for the layer count, the experts per token and the zero (identity) experts
    "longcat_flash": {"num_layers": LAYERS, "moe_topk": 2, "zero_expert_num": 2},
    # head_dim is the whole q/k head here, of which partial_rotary_factor (1/8) is the rotary part
    "deepseek_v4": {"head_dim": 32, "o_groups": 2, "o_lora_rank": 16},
    # its SWA layers' head_dim (per_layer_config) must be the two MLA parts, not the rotary one alone
    "dots3_note_text": {"num_key_value_heads": SIZES["num_attention_heads"], "head_dim": 8},
    # every default layer is a Mamba one, and transformers' cache then has no attention layer to count tokens by
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2)},
    "bamba": {"attn_layer_indices": [1, 3]},  # the same: its default places no attention layer
    # the QSA indexer of its indexed-attention layers has no defaults (all None); hc_lowrank is a width
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                       "indexer_compress_ratio": 2, "hc_lowrank": 8},
    # the audio encoder of phi4_multimodal's causal LM: its own names for depth and convolution widths
    "phi4_multimodal_audio": {"num_blocks": 2, "nemo_conv_channels": 32, "ext_pw_out_channel": 32,
                              "depthwise_separable_out_channel": 32},
    # ZAYA's config class accepts one expert per token only; its router MLP's width (256) shrunk with the rest
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},
    # Dory's config class reads layer counts in the released layout, where each layer is an attention block and an
    # mlp block (it halves them): 4 layers are 8 blocks, 1 input layer, 1 output layer and the 2 recurrent ones
    # between them (derived), so the looped section holds both attention kinds
    "dory": {"num_hidden_layers": 2 * LAYERS, "n_input_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"] * (LAYERS // 2)},
    # xLSTM's cache rounds the q/k and v widths (hidden_size x factor) up to a multiple of 64, its layers do not:
    # the factors that make both 64 wide at the test hidden_size
    "xlstm": {"qk_dim_factor": 64 / SIZES["hidden_size"], "v_dim_factor": 64 / SIZES["hidden_size"]},
    # BLT's hash embeddings have one table of encoder_hash_byte_group_vocab rows (500,002) per byte-group size (6):
    # 96M parameters at any hidden size
    "blt": {"encoder_hash_byte_group_vocab": 64},
    # the local encoder's and decoder's projections to and from the global transformer's width, which is its
    # hidden_size (shrunk there)
    **{arch: {"hidden_size_global": SIZES["hidden_size"]} for arch in ("blt_local_encoder", "blt_local_decoder")},
    # Dots3-Note's class checks that its vision and audio adapters take their encoder's width and give the text
    # model's: all hidden_size here
    "dots3_note_vision_encoder": {"adapter_in_dim": SIZES["hidden_size"], "adapter_out_dim": SIZES["hidden_size"]},
    "dots3_note_audio_encoder": {"adapter_input_size": SIZES["hidden_size"], "adapter_out_dim": SIZES["hidden_size"]},
}


def tiny_config(config_class: type[PretrainedConfig]) -> PretrainedConfig:
    """``config_class`` with test sizes on every key its defaults have (see the module docstring)."""
    defaults = config_class()
    values = defaults.to_dict()
    # the class's own names for the standard keys (n_embd, d_model, n_layer), where its attribute_map renames them
    aliases = {plain: stored for plain, stored in config_class.attribute_map.items()
               if stored in values and plain not in values}
    layers = values.get("num_hidden_layers", values.get(aliases.get("num_hidden_layers", "")))
    overrides = _derived(config_class, values)
    overrides.update(_sizes(values))
    overrides.update({stored: SIZES[plain] for plain, stored in aliases.items() if plain in SIZES and stored not in overrides})
    overrides.update(_periods(values))
    overrides.update({k: max(1, round(values[k] * LAYERS / layers)) for k in LAYER_COUNTS if values.get(k) and layers})
    if isinstance(values.get("per_layer_config"), dict) and layers:
        overrides["per_layer_config"] = _per_layer_config(values["per_layer_config"], values.get("layer_types"), layers,
                                                          ARCHITECTURES.get(defaults.model_type, {}))
    for key, sub_class in config_class.sub_configs.items():  # a composite (Llama4: text and vision configs)
        sub_class = _sub_config_class(sub_class, values.get(key))
        if sub_class is not None:
            overrides[key] = tiny_config(sub_class).to_dict()
    for key, value in values.items():
        if isinstance(value, float) and not isinstance(value, bool) and any(k in key for k in NOISE_KEYS):
            overrides[key] = 0.0
        elif key in TOKEN_IDS and value is not None:
            overrides[key] = TOKEN_IDS[key]
        elif isinstance(value, list) and layers and len(value) == layers and key not in SIZES:
            overrides[key] = _per_layer(value)
    overrides.update(ARCHITECTURES.get(defaults.model_type, {}))
    computed = [k for k in _computed(config_class, values) if k not in overrides]
    config = config_class(**{k: v for k, v in {**values, **overrides}.items() if k not in computed})
    if hasattr(defaults, "tie_word_embeddings"):
        config.tie_word_embeddings = defaults.tie_word_embeddings
    return config


def _sub_config_class(declared: Any, value: Any) -> type[PretrainedConfig] | None:
    """The config class of a composite's sub-config ``value`` (a dict): the declared class, or where the composite
    declares AutoConfig (Gemma3's SigLIP vision config, GOT-OCR2's text config) the class of its ``model_type``."""
    if not isinstance(value, dict):
        return None
    if isinstance(declared, type) and issubclass(declared, PretrainedConfig):
        return declared
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[value["model_type"]] if value.get("model_type") in CONFIG_MAPPING else None


def _derived(config_class: type[PretrainedConfig], values: dict[str, Any]) -> dict[str, None]:
    """Sizes the class derives itself from others where they are None (its field's default), such as Zamba's
    ``attention_hidden_size`` (2 x hidden_size) or xLSTM's ``embedding_dim``: None again, so that the class derives
    them from the test sizes by its own rules instead of keeping the full-size values."""
    if not dataclasses.is_dataclass(config_class):
        return {}
    fields = {f.name: f.default for f in dataclasses.fields(config_class)}
    return {key: None for key, value in values.items()
            if key in fields and fields[key] is None and isinstance(value, int) and not isinstance(value, bool)}


def _computed(config_class: type[PretrainedConfig], values: dict[str, Any]) -> list[str]:
    """Sizes the class computes in its own init, stored beside its fields but none of them (Zamba2's
    ``mamba_headdim``, expand x hidden_size / heads, and ``hybrid_layer_ids``, from the layer types): left out, so
    that the class computes them from the test sizes, not passed back at full size."""
    if not dataclasses.is_dataclass(config_class):
        return []
    fields = {f.name for f in dataclasses.fields(config_class)} | {f.name for f in dataclasses.fields(PretrainedConfig)}
    return [k for k, v in values.items() if k not in fields and isinstance(v, (int, list)) and not isinstance(v, bool)]


def _sizes(values: dict[str, Any]) -> dict[str, Any]:
    """Test sizes for the keys of ``values`` (a config's, or one layer's overrides of it) that SIZES has."""
    sizes = {k: v for k, v in SIZES.items() if k in values and (values[k] is not None or k in EXPLICIT)}
    for key, value in values.items():
        suffix = next((s for s in SUFFIXED if key.endswith("_" + s)), None)
        if suffix in values and key not in SIZES and isinstance(value, int) and not isinstance(value, bool):
            sizes[key] = min(value, SIZES[suffix])
    if "qk_rope_head_dim" in values and "head_dim" in values:
        sizes["head_dim"] = SIZES["qk_rope_head_dim"]  # multi-head latent attention: head_dim is the rotary part
    if "qk_head_dim" in values:  # derived by the class from the two parts, and stored
        sizes["qk_head_dim"] = SIZES["qk_nope_head_dim"] + SIZES["qk_rope_head_dim"]
    if "mamba_d_head" in values and "mamba_expand" in values:  # heads x head size = the expanded width
        sizes["mamba_d_head"] = values["mamba_expand"] * SIZES["hidden_size"] // SIZES["mamba_n_heads"]
    if values.get("mamba_d_ssm") and "mamba_d_head" in sizes:  # Falcon-H1's Mamba width: heads x head size
        sizes["mamba_d_ssm"] = sizes["mamba_d_head"] * SIZES["mamba_n_heads"]
    if {"num_heads", "head_dim", "expand"} <= set(values):  # Mamba2: the same, with the head size kept
        sizes["num_heads"] = values["expand"] * SIZES["hidden_size"] // SIZES["head_dim"]
    return sizes


def _periods(values: dict[str, Any]) -> dict[str, int]:
    """Layer kinds placed by period and offset (Jamba: attention every 8th layer from the 4th) every other layer
    from the second, so 4 layers hold both kinds."""
    found = {}
    for key, value in values.items():
        stem = key.removesuffix("_period")
        if key.endswith("_period") and isinstance(value, int) and value > 2 and f"{stem}_offset" in values:
            found.update({key: 2, f"{stem}_offset": 1})
    return found


def _per_layer(value: list) -> list:
    """A 4-layer list with each distinct entry of ``value`` in the order it first appears, cycled
    (``[sliding] * 5 + [full]`` -> ``[sliding, full, sliding, full]``)."""
    return [value[i] for i in _sources(value)]


def _sources(value: list) -> list[int]:
    """For each of the 4 tiny layers, the layer of ``value`` it copies: the first of each distinct entry, cycled."""
    keys = [_hashable(v) for v in value]
    firsts = [keys.index(k) for k in dict.fromkeys(keys)]
    return [firsts[i % len(firsts)] for i in range(LAYERS)]


def _per_layer_config(overrides: dict, layer_types: Any, layers: int, fixed: dict[str, Any]) -> dict[int, dict]:
    """transformers' sparse per-layer overrides (layer index -> the attributes that differ, Gemma4's wider
    full-attention heads) for the tiny layers: each takes the overrides of the layer it copies in
    ``layer_types`` (else in the overrides themselves), with test sizes (and the ``fixed`` values of its
    architecture)."""
    entries = [overrides.get(i, overrides.get(str(i))) for i in range(layers)]
    kinds = layer_types if isinstance(layer_types, list) and len(layer_types) == layers else entries

    def shrunk(entry: dict) -> dict:
        return {**entry, **_sizes(entry), **{k: v for k, v in fixed.items() if k in entry}}

    return {new: shrunk(entries[old]) for new, old in enumerate(_sources(kinds)) if entries[old]}


def _hashable(value: Any) -> Any:
    return repr(value) if isinstance(value, (list, dict)) else value
