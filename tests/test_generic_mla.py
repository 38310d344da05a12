"""What the generic adapter derives for multi-head latent attention (DeepSeek-V2/V3's MLA and the models built on
it), for replicated parameters inside a tensor-parallel block and for Llama4's expert-major experts, and what it
still refuses. No process group: plans are checked on meta models; their parity is shown by
scripts/architecture_sweep.py (tp2-sp, pp2-1f1b, consolidate-tp2-sp: deepseek_v2, deepseek_v3, deepseek_v32, axk1,
axk2, youtu, glm4_moe_lite, minicpm3, kimi_linear, bailing_hybrid, apertus, llama4_text) and by the conformance
kit's full matrix for deepseek_v3 (``plait check-adapter transformers:deepseek_v3``)."""

from __future__ import annotations

import pytest
from torch import nn

from plait import ConfigError, ParallelConfig, Registry
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.tp.styles import ExpertMajorExperts, LatentAttention, MoEExperts, ReplicatedGradSum

import plait_transformers
from plait_transformers.common import Refusal
from plait_transformers.derivation import tp_plan
from plait_transformers.latent import MLA_DOWN, latent_attention_rules
from plait_transformers.mlp import is_scalar_activation

MLA = ("deepseek_v2", "deepseek_v3", "axk1", "youtu", "glm4_moe_lite", "minicpm3")
ATTENTION = "model.layers.*.self_attn"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry()


def tiny(arch: str, **overrides):
    config = plait_transformers.plait_tiny_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def rules_of(registry, config) -> dict:
    return {r.pattern: r for r in registry.tp_plan(registry.resolve(config), config).rules}


def plan(config, registry, **layout):
    return plan_layout(build_meta_model(config), ParallelConfig(**layout), registry=registry)


# --------------------------------------------------------------------------------------------------
# Multi-head latent attention
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MLA)
def test_latent_attention_split_by_heads_with_its_down_projections_replicated(registry, arch):
    """Whether transformers' plan styles the block (deepseek_v2, glm4_moe_lite, minicpm3) or leaves it out
    (deepseek_v3, youtu, axk1), the block gets one LatentAttention rule and sequence parallelism runs."""
    config = tiny(arch)
    attention = rules_of(registry, config)[ATTENTION]
    assert isinstance(attention, LatentAttention)
    assert (attention.q, attention.kv_b, attention.o, attention.replicated) == ("q_b_proj", "kv_b_proj", "o_proj",
                                                                                 MLA_DOWN)
    # tiny heads: 4 x (nope 4 + rope 4) for q, 4 x (nope 4 + v 8) for kv_b, 4 x v 8 into o_proj
    assert (attention.num_heads, attention.q_head_dim, attention.kv_head_dim, attention.v_head_dim) == (4, 8, 12, 8)
    assert attention.local_attrs == ("num_heads",)
    sp = registry.sp_plan(registry.resolve(config), config)
    assert not any("self_attn" in norm for norm in sp.norms)  # the block's own rule accounts for its modules


def test_latent_attention_shards_of_one_rank(registry):
    shards = plan(tiny("deepseek_v3"), registry, tp=2, sp=True).shards_by_rank[1]
    block = "model.layers.0.self_attn"
    q, kv_b, o = (shards[f"{block}.{c}"] for c in ("q_b_proj", "kv_b_proj", "o_proj"))
    assert q.weight.dim == 0 and q.weight.ranges == ((16, 32),)  # heads 2-3 of 8 features each
    assert kv_b.weight.dim == 0 and kv_b.weight.ranges == ((24, 48),)  # heads 2-3 of k_nope 4 | v 8
    assert o.weight.dim == 1 and o.weight.ranges == ((16, 32),)  # heads 2-3 of v 8
    assert q.entered_by_parent and kv_b.entered_by_parent and q.local_attrs == {"num_heads": 2}
    for down in MLA_DOWN:
        shard = shards[f"{block}.{down}"]
        assert isinstance(shard.style, ReplicatedGradSum) and shard.grad_sum_block == 2
        assert shard.weight.local_shape == shard.weight.full_shape
    assert shards[f"{block}.kv_a_proj_with_mqa"].weight.full_shape == (16 + 4, 32)  # latent | shared rotary key


def test_latent_attention_without_a_q_lora_splits_q_proj(registry):
    """DeepSeek-V2-Lite: no q_lora_rank, q_proj projects the hidden states to heads directly."""
    config = tiny("deepseek_v2", q_lora_rank=None)
    attention = rules_of(registry, config)[ATTENTION]
    assert attention.q == "q_proj" and attention.replicated == ("kv_a_proj_with_mqa", "kv_a_layernorm")
    shard = plan(config, registry, tp=2, sp=True).shards_by_rank[0]["model.layers.0.self_attn.q_proj"]
    assert shard.weight.ranges == ((0, 16),) and shard.weight.full_shape == (32, 32)


def test_sparse_attention_indexer_computing_without_gradients_is_replicated(registry):
    """DeepSeek-V3.2's indexer (forward under torch.no_grad) picks the tokens each query attends to: replicated on the
    full sequence it picks the same ones on every rank, and it has no gradient to sum."""
    config = tiny("deepseek_v32")
    attention = rules_of(registry, config)[ATTENTION]
    indexer = ("indexer.wq_b", "indexer.wk", "indexer.k_norm", "indexer.weights_proj")
    assert isinstance(attention, LatentAttention) and attention.replicated == (*MLA_DOWN, *indexer)
    shard = plan(config, registry, tp=2, sp=True).shards_by_rank[1]["model.layers.0.self_attn.indexer.k_norm"]
    assert shard.weight.local_shape == shard.weight.full_shape and shard.bias is not None

@pytest.mark.parametrize(("arch", "gates"), [("kimi_linear", ()), ("bailing_hybrid", ("g_proj",))])
def test_hybrid_latent_attention_layers_get_one_rule_each(registry, arch, gates):
    """Kimi-Linear and Bailing-Hybrid alternate delta attention and latent attention at ``self_attn``: one
    LatentAttention per latent layer, the delta attention kept whole (run on the whole sequence under SP).
    Bailing-Hybrid's per-head output gate (g_proj: one value per head) splits with the heads."""
    config = tiny(arch)
    rules = rules_of(registry, config)
    latent = sorted(p for p, r in rules.items() if isinstance(r, LatentAttention))
    assert latent == ["model.layers.1.self_attn", "model.layers.3.self_attn"]
    assert all(rules[p].head_columns == gates for p in latent)
    assert {"model.layers.0.self_attn", "model.layers.2.self_attn"} <= {p for p, r in rules.items()
                                                                       if type(r).__name__ == "WholeSequence"}
    if gates:
        shard = plan(config, registry, tp=2, sp=True).shards_by_rank[1]["model.layers.1.self_attn.g_proj"]
        assert shard.weight.ranges == ((2, 4),) and shard.entered_by_parent

def test_latent_attention_with_a_gated_query_splits_q_and_gate_per_head(registry):
    """AXK2's q_gate_proj projects [q | gate] per head (nope 4 + rope 4 | v 8): whole heads of both per rank."""
    config = tiny("axk2")
    attention = rules_of(registry, config)[ATTENTION]
    assert attention.q == "q_gate_proj" and attention.q_head_dim == 16
    shard = plan(config, registry, tp=2, sp=True).shards_by_rank[1]["model.layers.0.self_attn.q_gate_proj"]
    assert shard.weight.ranges == ((32, 64),)

def test_latent_attention_heads_tp_does_not_divide_are_refused(registry):
    config = tiny("deepseek_v3")
    attention = rules_of(registry, config)[ATTENTION]
    block = build_meta_model(config).get_submodule("model.layers.0.self_attn")
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tp=8"):
        attention.shards("model.layers.0.self_attn", block, 8, 0)


def test_latent_attention_with_another_module_inside_is_refused():
    """A parameterised module beside the projections and norms (a sparse-attention indexer) has no rule."""
    config = tiny("deepseek_v3")
    model = build_meta_model(config)
    for layer in model.model.layers:
        layer.self_attn.indexer = nn.Linear(32, 4, device="meta")
    with pytest.raises(Refusal, match=r"self_attn\.indexer: a module with parameters inside latent attention"):
        tp_plan(model, config, "model.layers", [])


def test_latent_attention_styles_other_than_the_split_by_heads_are_refused():
    config = tiny("deepseek_v2")
    block = build_meta_model(config).get_submodule("model.layers.0.self_attn")
    with pytest.raises(Refusal, match=r"transformers' styles \{'q_b_proj': 'rowwise'\} on latent attention"):
        latent_attention_rules(build_meta_model(config), config, ATTENTION, block, {"q_b_proj": "rowwise"})


# --------------------------------------------------------------------------------------------------
# Replicated parameters inside a tensor-parallel block
# --------------------------------------------------------------------------------------------------


def test_scalar_activation_parameters_are_summed_over_tp(registry):
    """Apertus' xIELU: alpha_p and alpha_n ([1]) act elementwise on up_proj's split features."""
    config = tiny("apertus")
    assert isinstance(rules_of(registry, config)["model.layers.*.mlp.act_fn"], ReplicatedGradSum)
    shard = plan(config, registry, tp=2, sp=True).shards_by_rank[1]["model.layers.0.mlp.act_fn"]
    assert shard.grad_sum_block == 2 and set(shard.params) == {"alpha_p", "alpha_n"}
    assert all(spec.local_shape == spec.full_shape == (1,) for spec in shard.params.values())


def test_only_scalar_activations_on_split_features_qualify():
    mlp = build_meta_model(tiny("apertus")).get_submodule("model.layers.0.mlp")
    assert is_scalar_activation(mlp, "act_fn", ["up_proj"])
    assert not is_scalar_activation(mlp, "act_fn", ["down_proj"])  # not what the forward applies it to
    mlp.act_fn = nn.PReLU(64, device="meta")  # one parameter per feature: it would need a split of its own
    assert not is_scalar_activation(mlp, "act_fn", ["up_proj"])
    mlp.act_fn = nn.PReLU(1, device="meta")
    assert is_scalar_activation(mlp, "act_fn", ["up_proj"])


def test_per_feature_parameters_inside_a_tensor_parallel_block_stay_refused():
    config = tiny("apertus")
    model = build_meta_model(config)
    for layer in model.model.layers:
        layer.mlp.act_fn = nn.PReLU(64, device="meta")
    with pytest.raises(Refusal, match=r"mlp\.act_fn: replicated parameters inside a tensor-parallel block see split "
                                      r"activations; plait cannot tell how to sum their gradients"):
        tp_plan(model, config, "model.layers", [])



# --------------------------------------------------------------------------------------------------
# Experts taking every token once per expert (Llama4)
# --------------------------------------------------------------------------------------------------


def test_llama4_expert_major_experts_split_on_the_intermediate_dim(registry):
    """Llama4TextExperts.forward(hidden_states) takes [experts * tokens, hidden], pre-scaled by the router: split
    like the usual experts (stored [E, in, out]), entered through the expert-major region."""
    config = tiny("llama4_text")
    rules = rules_of(registry, config)
    assert type(rules["model.layers.*.feed_forward.experts"]) is ExpertMajorExperts
    shard = plan(config, registry, tp=2, sp=True).shards_by_rank[1]["model.layers.0.feed_forward.experts"]
    inter = config.intermediate_size
    assert shard.transposed and shard.params["gate_up_proj"].dim == 2
    assert shard.params["gate_up_proj"].ranges == ((inter // 2, inter), (inter + inter // 2, 2 * inter))
    assert shard.params["down_proj"].dim == 1 and shard.params["down_proj"].ranges == ((inter // 2, inter),)


def test_usual_experts_keep_the_routing_region(registry):
    assert type(rules_of(registry, tiny("qwen3_moe"))["model.layers.*.mlp.experts"]) is MoEExperts
