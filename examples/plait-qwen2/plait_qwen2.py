"""plait adapter for transformers' Qwen2, installed from outside plait: Llama's module layout with biases
on q, k and v. Column-parallel biases are split like their weight's output rows (a replicated kv head's
bias is replicated with it), so Llama's plans serve as they are: re-exported from plait-llama."""

from plait_llama import plait_leaf_modules, plait_pipeline_plan, plait_sp_plan, plait_tp_plan  # noqa: F401

from plait import AdapterInfo, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="qwen2", architectures=("qwen2", "Qwen2ForCausalLM"))


@hookimpl
def plait_tiny_config():
    from transformers import Qwen2Config

    # One kv head: at any tp > 1 it is replicated, biased k/v projections included.
    return Qwen2Config(vocab_size=71, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64)
