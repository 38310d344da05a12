"""plait adapter for transformers' Mistral: Llama's module layout, with sliding-window attention that
transformers' own mask builder handles on every rank."""

from plait import AdapterInfo, Attention, Column, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="mistral", architectures=("mistral", "MistralForCausalLM"))


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
    from transformers import MistralConfig

    # One kv head (replicated at any tp > 1) and a sliding window shorter than the test sequences.
    return MistralConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64, sliding_window=6)
