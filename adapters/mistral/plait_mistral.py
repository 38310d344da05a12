"""plait adapter for transformers' Mistral: Llama's module layout, so Llama's plans, re-exported from
plait-llama. Sliding-window attention needs nothing from plait: transformers' own mask builder handles it on
every rank."""

from plait_llama import plait_leaf_modules, plait_pipeline_plan, plait_sp_plan, plait_tp_plan  # noqa: F401

from plait import AdapterInfo, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="mistral", architectures=("mistral", "MistralForCausalLM"))


@hookimpl
def plait_tiny_config():
    from transformers import MistralConfig

    # One kv head (replicated at any tp > 1) and a sliding window shorter than the test sequences.
    return MistralConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64, sliding_window=6)
