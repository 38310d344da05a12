"""The generic adapter (plait-transformers): plans derived from transformers' declarations, its refusals, and
the registry's precedence of explicit adapters over it. No process group: plans are checked on meta models
with ``plan_layout``; the parity of the derived plans is tests/test_generic_conformance.py."""

from __future__ import annotations

import types

import pytest

import plait
from plait import AdapterError, AdapterInfo, Attention, Column, ConfigError, ParallelConfig, Registry, Row, hookimpl
from plait.layout_plan import plan_layout
from plait.meta import build_meta_model
from plait.registry import served_architectures
from plait.tp.styles import ReplicatedGradSum, ScaledVocabEmbedding, VocabEmbedding, VocabHead

import plait_transformers


def tiny(arch: str, **overrides):
    config = plait_transformers.plait_tiny_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry()


def plan(config, registry, **layout):
    return plan_layout(build_meta_model(config), ParallelConfig(**layout), registry=registry)


# --------------------------------------------------------------------------------------------------
# Precedence
# --------------------------------------------------------------------------------------------------


def test_explicit_adapter_wins_and_the_generic_serves_the_rest(registry):
    assert registry.resolve(types.SimpleNamespace(model_type="llama")).name == "llama"
    assert registry.resolve(types.SimpleNamespace(model_type="qwen3")).name == "transformers"
    adapter, why = registry.explain(types.SimpleNamespace(model_type="mistral"))
    assert adapter.name == "mistral" and why == "claimed by the explicit adapter 'mistral'"


def test_served_architectures_say_who_and_why(registry):
    rows = {arch: (name, why) for arch, name, why in served_architectures(registry)}
    assert rows["llama"] == ("llama", "claimed by the explicit adapter 'llama'")
    assert rows["qwen3"][0] == "transformers" and "derives its plans" in rows["qwen3"][1]
    assert rows["bart"][0] is None and "bart is an encoder-decoder model" in rows["bart"][1]


@pytest.mark.parametrize(("model_type", "reason"), [
    ("t5", "t5 is an encoder-decoder model; plait trains decoder-only causal LMs"),
    ("opt", "OPTConfig declares no base_model_tp_plan"),
    ("no_such_model", "transformers has no config class for model_type 'no_such_model'"),
])
def test_what_the_generic_adapter_does_not_serve_is_named(registry, model_type, reason):
    with pytest.raises(AdapterError, match=f"no plait adapter claims architecture '{model_type}'.*{reason}"):
        registry.resolve(types.SimpleNamespace(model_type=model_type))


def generic(name: str, refusal=True) -> types.ModuleType:
    module = types.ModuleType(f"generic_{name}")
    module.plait_adapter_info = hookimpl(lambda: AdapterInfo(name, (), generic=True))
    module.plait_tp_plan = hookimpl(lambda config: plait.TPPlan(()))
    module.plait_sp_plan = hookimpl(lambda config: None)
    module.plait_leaf_modules = hookimpl(lambda config: [])
    if refusal:
        module.plait_refusal = hookimpl(lambda config: None)
    return module


def test_two_generic_adapters_are_an_error():
    registry = Registry(autoload=False)
    registry.register(generic("one"))
    with pytest.raises(AdapterError, match="two generic adapters are installed: 'one'.*'two'"):
        registry.register(generic("two"))


def test_a_generic_adapter_must_say_what_it_refuses():
    with pytest.raises(AdapterError, match="'g' is generic but has no plait_refusal hook"):
        Registry(autoload=False).register(generic("g", refusal=False))


# --------------------------------------------------------------------------------------------------
# Derived plans
# --------------------------------------------------------------------------------------------------


def test_qwen3_attention_heads_from_the_config_and_per_head_norms_summed(registry):
    config = tiny("qwen3")
    rules = {r.pattern: r for r in registry.tp_plan(registry.resolve(config), config).rules}
    attention = rules["model.layers.*.self_attn"]
    assert isinstance(attention, Attention)
    assert (attention.q, attention.k, attention.v, attention.o) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 2, 8)
    assert attention.local_attrs == {"num_key_value_groups": "kv_groups"}
    assert isinstance(rules["model.layers.*.self_attn.q_norm"], ReplicatedGradSum)
    assert isinstance(rules["model.layers.*.mlp.gate_proj"], Column)
    assert isinstance(rules["model.layers.*.mlp.down_proj"], Row)
    assert isinstance(rules["model.embed_tokens"], VocabEmbedding) and isinstance(rules["lm_head"], VocabHead)
    sp = registry.sp_plan(registry.resolve(config), config)
    assert (sp.begin, sp.end) == ("model.layers.0", "model.norm")
    assert set(sp.norms) == {"model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"}


def test_per_head_norm_gradients_are_summed_once_under_sp(registry):
    layout = plan(tiny("qwen3"), registry, tp=2, sp=True)
    shard = layout.shards_by_rank[1]["model.layers.0.self_attn.q_norm"]
    assert shard.grad_sum_block == 2 and shard.weight.local_shape == (8,)


def test_gemma3_scaled_embedding_keeps_its_scale(registry):
    config = tiny("gemma3_text")
    rules = {r.pattern: r for r in registry.tp_plan(registry.resolve(config), config).rules}
    assert isinstance(rules["model.embed_tokens"], ScaledVocabEmbedding)


def test_pipeline_plan_from_transformers_pp_plan(registry):
    config = tiny("gemma2")
    pipeline = registry.pipeline_plan(registry.resolve(config), config)
    assert pipeline.first == ("model.embed_tokens", "model.rotary_emb") and pipeline.layers == "model.layers"
    assert pipeline.last == ("model.norm", "lm_head") and pipeline.neutralize == ()
    assert registry.leaf_modules(registry.resolve(config), config) == ["model.layers.*"]


def test_phi_partial_rotary_and_dense_output_projection(registry):
    config = tiny("phi")
    rules = {r.pattern: r for r in registry.tp_plan(registry.resolve(config), config).rules}
    assert rules["model.layers.*.self_attn"].o == "dense"
    assert registry.sp_plan(registry.resolve(config), config).end == "model.final_layernorm"


# --------------------------------------------------------------------------------------------------
# Refusals: before any process group, naming the architecture, the module and what is missing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "layout", "message"), [
    ("olmo2", dict(tp=2, sp=False),
     "olmo2: model.layers.*.self_attn.q_proj: transformers' style 'colwise_gather_output' gathers the projection's output"),
    ("youtu", dict(tp=2, sp=True),
     "youtu: model.layers.*.self_attn.q_a_proj: Linear has replicated matrices inside the decoder layers"),
    ("apertus", dict(tp=2, sp=False),
     "apertus: model.layers.*.mlp.act_fn: replicated parameters inside a tensor-parallel block"),
])
def test_refused_before_any_process_group(registry, arch, layout, message):
    with pytest.raises(ConfigError, match="cannot derive this plan: " + message.replace("*", r"\*")):
        plan(tiny(arch), registry, **layout)


@pytest.mark.parametrize("arch", ["olmo2", "youtu", "apertus"])
def test_refused_plans_still_train_data_parallel(registry, arch):
    """tp=pp=1 needs no plan: an architecture whose tp plan is refused still lays out (and trains) over dp."""
    layout = plan(tiny(arch), registry, tp=1, pp=1, gradient_checkpointing=True)
    assert layout.adapter.name == "transformers" and layout.leaves


def test_youtu_tensor_parallel_without_sp_keeps_its_attention_replicated(registry):
    layout = plan(tiny("youtu"), registry, tp=2, sp=False)
    assert not any("self_attn" in name for name in layout.shards_by_rank[0])


# --------------------------------------------------------------------------------------------------
# Tiny configs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text", "phi", "starcoder2"])
def test_tiny_config_is_small_and_exercises_the_paths(arch):
    config = tiny(arch)
    assert config.num_hidden_layers == 4 and config.vocab_size == 61 and config.hidden_size == 32
    assert config.num_attention_heads == 4
    assert all(getattr(config, k, 0.0) in (0.0, None) for k in ("attention_dropout", "hidden_dropout", "resid_pdrop"))


def test_tiny_config_alternates_layer_kinds():
    assert tiny("gemma2").layer_types == ["sliding_attention", "full_attention"] * 2


def test_tiny_config_of_a_refused_architecture_says_why():
    with pytest.raises(ConfigError, match="cannot serve 'opt': OPTConfig declares no base_model_tp_plan"):
        plait_transformers.plait_tiny_config("opt")
