"""The Llama adapter with attention written as plain linears and ``o_proj`` marked Column instead of Row:
o_proj then expects the full hidden width but gets this rank's heads, and the forward raises on every rank."""

from plait_llama import plait_leaf_modules, plait_pipeline_plan, plait_sp_plan, plait_tiny_config  # noqa: F401

from plait import AdapterInfo, Column, Row, TPPlan, VocabEmbedding, VocabHead, hookimpl


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="llama-o-proj-column", architectures=("llama",))


@hookimpl
def plait_tp_plan(config):
    return TPPlan((
        *(Column(f"model.layers.*.self_attn.{name}") for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
        Column("model.layers.*.mlp.gate_proj"),
        Column("model.layers.*.mlp.up_proj"),
        Row("model.layers.*.mlp.down_proj"),
        VocabEmbedding("model.embed_tokens"),
        VocabHead("lm_head"),
    ))
