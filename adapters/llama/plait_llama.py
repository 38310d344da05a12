"""plait adapter for transformers' Llama: which modules shard how. Facts only; plait applies them."""

from plait import (
    AdapterInfo, Attention, Column, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead, hookimpl,
)


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="llama", architectures=("llama", "LlamaForCausalLM"))


@hookimpl
def plait_tp_plan(config):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return TPPlan((
        Attention("model.layers.*.self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
                  num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                  head_dim=head_dim, local_attrs={"num_key_value_groups": "kv_groups"}),
        Column("model.layers.*.mlp.gate_proj"),
        Column("model.layers.*.mlp.up_proj"),
        Row("model.layers.*.mlp.down_proj"),
        VocabEmbedding("model.embed_tokens"),
        VocabHead("lm_head"),
    ))


@hookimpl
def plait_sp_plan(config):
    return SPPlan(begin="model.layers.0", end="model.norm",
                  norms=("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"))


@hookimpl
def plait_pipeline_plan(config):
    return PipelinePlan(first=("model.embed_tokens", "model.rotary_emb"), layers="model.layers",
                        last=("model.norm", "lm_head"))


@hookimpl
def plait_leaf_modules(config):
    return ["model.layers.*"]


@hookimpl
def plait_tiny_config():
    from transformers import LlamaConfig

    # 2 kv heads for 4 q heads: GQA, and kv-head replication at tp=4; vocab 61 pads under tp.
    return LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
