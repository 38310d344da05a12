"""plait adapter for transformers' Qwen2, installed from outside plait: Llama's module layout with biases
on q, k and v. Column-parallel biases are split like their weight's output rows (a replicated kv head's
bias is replicated with it), so the plan needs nothing beyond Llama's."""

from plait import AdapterInfo, Attention, Column, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="qwen2", architectures=("qwen2", "Qwen2ForCausalLM"))


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
    from transformers import Qwen2Config

    # One kv head: at any tp > 1 it is replicated, biased k/v projections included.
    return Qwen2Config(vocab_size=71, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64)
