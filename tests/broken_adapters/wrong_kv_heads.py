"""The Llama adapter with a misspelt config field: ``num_kv_heads`` does not exist on LlamaConfig, so the
plan falls back to one kv head. Every rank then takes kv head 0 for its q heads: wrong numbers, no error."""

from plait_llama import plait_leaf_modules, plait_pipeline_plan, plait_sp_plan, plait_tiny_config  # noqa: F401

from plait import AdapterInfo, Attention, Column, Row, TPPlan, VocabEmbedding, VocabHead, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="llama-wrong-kv-heads", architectures=("llama",))


@hookimpl
def plait_tp_plan(config):
    head_dim = config.hidden_size // config.num_attention_heads
    return TPPlan((
        Attention("model.layers.*.self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
                  num_heads=config.num_attention_heads, num_kv_heads=getattr(config, "num_kv_heads", 1),
                  head_dim=head_dim, local_attrs={"num_key_value_groups": "kv_groups"}),
        Column("model.layers.*.mlp.gate_proj"),
        Column("model.layers.*.mlp.up_proj"),
        Row("model.layers.*.mlp.down_proj"),
        VocabEmbedding("model.embed_tokens"),
        VocabHead("lm_head"),
    ))
