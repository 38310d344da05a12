"""What the generic adapter derives for attention blocks beyond plain q/k/v/o: per-head bare parameters
(attention sinks), q projections carrying a per-head gate, per-layer head counts, per-head gate projections,
and attention blocks transformers' plan leaves out; and what it refuses there. Single process, meta models;
parity is shown by scripts/architecture_sweep.py (tp2-sp, pp2-1f1b, consolidate-tp2-sp for each)."""

from __future__ import annotations

import re

import pytest

from plait import Attention, ConfigError, ParallelConfig, Registry
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.tp.styles import HeadParams, ReplicatedGradSum

from plait_transformers.derivation import derive
from plait_transformers.tiny import tiny_config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry()


def tiny(arch: str):
    return tiny_config(CONFIG_MAPPING[arch])


def rules_of(config) -> dict:
    return {r.pattern: r for r in derive(config).tp.rules}


def shards(config, registry, rank: int, **layout) -> dict:
    layout = plan_layout(build_meta_model(config), ParallelConfig(**{"tp": 2, "sp": True, **layout}), registry=registry)
    return layout.shards_by_rank[rank]


@pytest.mark.parametrize("arch", ["granite_swa", "granitemoe_swa"])
def test_sinks_split_with_the_q_heads(registry, arch):
    """transformers shards ``sinks`` [heads] colwise beside q; plait keeps each rank's heads' sinks."""
    attention = rules_of(tiny(arch))["model.layers.*.self_attn"]
    assert isinstance(attention, Attention) and attention.head_params == ("sinks",)
    for rank, heads in ((0, (0, 2)), (1, (2, 4))):
        block = shards(tiny(arch), registry, rank)["model.layers.0.self_attn"]
        assert isinstance(block.style, HeadParams) and block.spec("sinks").ranges == (heads,)
        assert block.spec("sinks").full_shape == (4,) and block.grad_sum_block == 1


def test_sinks_with_kv_heads_replicated_stay_per_q_head(registry):
    """kv heads fewer than tp are replicated, q heads (and their sinks) never are."""
    layout = shards(tiny("granite_swa"), registry, 3, tp=4)
    assert layout["model.layers.0.self_attn"].spec("sinks").ranges == ((3, 4),)
    assert layout["model.layers.0.self_attn.k_proj"].grad_sum_block == 2


def test_per_layer_kv_heads_and_sinks_give_one_rule_per_layer(registry):
    """MiMo-V2-Flash's sliding layers have twice the kv heads and sinks; full layers neither."""
    config = tiny("mimo_v2_flash")
    rules = rules_of(config)
    assert "model.layers.*.self_attn" not in rules
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    assert sliding and len(sliding) < 4
    for i in range(4):
        attention = rules[f"model.layers.{i}.self_attn"]
        swa = i in sliding
        assert (attention.num_kv_heads, attention.head_params) == ((4, ("sinks",)) if swa else (2, ()))
    layout = shards(config, registry, 1)
    assert layout[f"model.layers.{sliding[0]}.self_attn.k_proj"].weight.ranges == ((16, 32),)
    assert layout[f"model.layers.{sliding[0]}.self_attn"].spec("sinks").ranges == ((2, 4),)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_gated_q_projection_split_by_whole_heads(registry, arch):
    """q_proj emits [q_h | gate_h] per head (viewed as (heads, 2 x head_dim), chunked): each rank keeps its
    heads' query and gate, one contiguous column range."""
    attention = rules_of(tiny(arch))["model.layers.*.self_attn"]
    assert attention.q_chunks == 2 and (attention.num_heads, attention.head_dim) == (4, 8)
    layout = plan_layout(build_meta_model(tiny(arch)), ParallelConfig(tp=2), registry=registry).shards_by_rank[1]
    name = next(n for n in layout if n.endswith("self_attn.q_proj"))
    assert layout[name].weight.ranges == ((32, 64),)
    assert layout[name.replace("q_proj", "o_proj")].weight.ranges == ((16, 32),)


@pytest.mark.parametrize(("arch", "declared"), [("qwen3_next", True), ("olmo_hybrid", False)])
def test_linear_attention_kept_whole_and_run_on_the_whole_sequence(registry, arch, declared):
    """A gated delta net scans along the sequence: transformers' plan gathers all its projections (Qwen3-Next) or
    leaves it out (OLMo-Hybrid); plait keeps it whole on every rank (WholeSequence: gathered under SP, its
    gradients summed over tp as the SP norms')."""
    config = tiny(arch)
    derived = derive(config)
    rule = {r.pattern: r for r in derived.tp.rules}["model.layers.*.linear_attn"]
    assert type(rule).__name__ == "WholeSequence"
    assert any("linear_attn" in note and "whole sequence" in note for note in derived.notes) == (not declared)
    assert not any(r.pattern.startswith("model.layers.*.linear_attn.") for r in derived.tp.rules)
    norms = derived.sp.norms
    model = build_meta_model(config)
    inner = {f"model.layers.*.linear_attn.{n}" if n else "model.layers.*.linear_attn"
             for n, m in next(l.linear_attn for l in model.model.layers if hasattr(l, "linear_attn")).named_modules()
             if any(True for _ in m.parameters(recurse=False))}
    assert inner and inner <= set(norms)
    layout = plan_layout(model, ParallelConfig(tp=2, sp=True), registry=registry)
    name = next(n for n in layout.shards_by_rank[0] if n.endswith("linear_attn"))
    assert layout.shards_by_rank[0][name].style.label == "whole_sequence"


def test_laguna_per_layer_heads_and_per_head_gate(registry):
    """Laguna's layers set their own q head count (num_attention_heads_per_layer) and gate each head's output by
    g_proj: heads read from the widths, confirmed by the block's num_heads; g_proj split with the heads."""
    config = tiny("laguna")
    attention = rules_of(config)["model.layers.*.self_attn"]
    heads = config.num_attention_heads_per_layer[0]
    assert attention.num_heads == heads and attention.head_columns == ("g_proj",)
    assert isinstance(rules_of(config)["model.layers.*.self_attn.q_norm"], ReplicatedGradSum)
    layout = shards(config, registry, 1)
    g_width = build_meta_model(config).model.layers[0].self_attn.g_proj.out_features
    assert layout["model.layers.0.self_attn.g_proj"].weight.ranges == ((g_width // 2, g_width),)


@pytest.mark.parametrize(("arch", "sinks"), [("granitemoe", ()), ("granitemoeshared", ()), ("phimoe", ()),
                                             ("hunyuan_v1_moe", ()), ("flint", ("sinks",))])
def test_attention_the_plan_leaves_out_is_split_by_heads(registry, arch, sinks):
    """These plans declare only the experts; the attention blocks found in the model get the declared kind's
    rule (Flint's sinks, passed to the attention function as ``s_aux``, split with the heads), and the
    derivation says so."""
    derived = derive(tiny(arch))
    attention = {r.pattern: r for r in derived.tp.rules}["model.layers.*.self_attn"]
    assert isinstance(attention, Attention) and (attention.num_heads, attention.num_kv_heads) == (4, 2)
    assert attention.head_params == sinks
    assert any("leaves out" in note and "self_attn" in note for note in derived.notes)
    layout = shards(tiny(arch), registry, 0)
    assert layout["model.layers.0.self_attn.q_proj"].weight.ranges == ((0, 16),)


def test_undeclared_attention_output_gate_split_with_the_heads(registry):
    """AFMoE's attention (left out of its plan) multiplies its output by sigmoid(gate_proj(hidden_states)),
    elementwise over heads x head_dim: gate_proj is split with the q heads."""
    attention = rules_of(tiny("afmoe"))["model.layers.*.self_attn"]
    assert attention.head_columns == ("gate_proj",)
    layout = shards(tiny("afmoe"), registry, 1)
    assert layout["model.layers.0.self_attn.gate_proj"].weight.ranges == ((16, 32),)
    # its first layer's dense MLP, down(act(gate(x)) * up(x)), also left out of the plan, is split column / row
    assert layout["model.layers.0.mlp.gate_proj"].style.label == "column"
    assert layout["model.layers.0.mlp.down_proj"].style.label == "row"
    assert "model.layers.1.mlp.gate_proj" not in layout  # layer 1 holds the experts there


def test_beam_gate_and_per_head_gate_bias(registry):
    """Beam gates each head's output by sigmoid(gate_proj(x) + gate_bias[head]); transformers shards both
    colwise: gate_proj's outputs and the bare gate_bias [heads] go with the q heads."""
    attention = rules_of(tiny("beam"))["model.layers.*.self_attn"]
    assert (attention.head_columns, attention.head_params) == (("gate_proj",), ("gate_bias",))
    layout = shards(tiny("beam"), registry, 1)
    assert layout["model.layers.0.self_attn"].spec("gate_bias").ranges == ((2, 4),)


def test_minimax_lightning_layers_kept_whole_softmax_layers_split(registry):
    """MiniMax alternates softmax attention (q/k/v/o, split by heads) with lightning attention (a linear
    attention scanning the sequence, no q_proj) at the same path: one rule per layer, the lightning blocks kept
    whole and run on the whole sequence under SP."""
    config = tiny("minimax")
    rules = rules_of(config)
    for i, kind in enumerate(config.layer_types):
        rule = rules[f"model.layers.{i}.self_attn"]
        assert type(rule).__name__ == ("Attention" if kind == "full_attention" else "WholeSequence")
    assert "model.layers.*.self_attn.qkv_proj" in derive(config).sp.norms
    assert "model.layers.1.self_attn.qkv_proj" not in shards(config, registry, 0)


def test_per_head_norms_stay_local_where_transformers_gathers_q_k_v(registry):
    """MiniMax-M3's plan gathers q, k and v around norms that are per head (head_dim wide): each rank's heads
    need only their own, so the attention splits by heads and the norms' gradients are summed."""
    rules = rules_of(tiny("minimax_m3_vl_text"))
    assert type(rules["model.layers.*.self_attn"]) is Attention
    assert isinstance(rules["model.layers.*.self_attn.q_norm"], ReplicatedGradSum)


@pytest.mark.parametrize("arch", ["granite_swa", "qwen3_next", "minimax"])
def test_show_derived_prints_the_new_rules_as_loadable_code(arch):
    """``plait plan --show-derived``: per-head parameters, gated q, per-layer and whole-sequence rules print as an
    adapter giving the same plans."""
    import types

    import plait_transformers

    module = types.ModuleType(f"derived_{arch}")
    exec(compile(plait_transformers.show_derived(arch), f"<derived {arch}>", "exec"), module.__dict__)
    registry = Registry(autoload=False)
    adapter = registry.register(module)
    config = plait_transformers.plait_tiny_config(arch)
    assert registry.tp_plan(adapter, config) == derive(config).tp
    assert registry.sp_plan(adapter, config) == derive(config).sp


def test_plan_models_a_linear_attention_model(tmp_path, capsys):
    """plait plan traces Qwen3.5's layers (a gated delta net's conv kernel is 3-D, not experts stacked) and shows
    the delta net kept whole."""
    from plait.cli import main

    import plait_transformers

    path = tmp_path / "config.json"
    plait_transformers.plait_tiny_config("qwen3_5_text").to_json_file(path)
    main(["plan", "--model_config", str(path), "--block_size", "16", "--tensor_parallel_size", "2",
          "--per_device_train_batch_size", "1"])
    out = capsys.readouterr().out
    assert "model.layers.*.linear_attn" in out and "whole_sequence" in out


def test_attention_blocks_of_different_classes_at_one_path_are_refused(monkeypatch):
    """Layers whose attention blocks differ in class at one module path (transformers 5.23's Inkling2: full and
    sliding attention) cannot be told apart by plait's patterns. Built here from qwen3 with one layer's block
    given another class, so that the rule stays tested whatever a release does to the model that showed it."""
    from plait_transformers import derivation
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    class SlidingAttention(Qwen3Attention):
        pass

    def build(config):
        model = build_meta_model(config)
        model.model.layers[1].self_attn.__class__ = SlidingAttention
        return model

    monkeypatch.setattr(derivation, "build_meta_model", build)
    monkeypatch.setattr(derivation, "_CACHE", {})
    refusal = derive(tiny("qwen3")).tp
    assert str(refusal) == ("qwen3: model.layers.*.self_attn: attention blocks of different classes ['Qwen3Attention', "
                            "'SlidingAttention'] at one module path, which plait's patterns cannot tell apart")


@pytest.mark.parametrize(("arch", "message"), [
    ("doge", "doge: model.layers.*.self_attn.dt_proj: transformers' style 'rowwise' inside attention has no plait rule "
     "beside the output projection: a row split sums it over tp into every head's outputs on every rank"),
    ("gemma3n_text", "gemma3n_text: model.layers.*.self_attn: model.layers.2.self_attn (Gemma3nTextAttention) is softmax "
     "attention without ['k_proj', 'v_proj'], unlike other layers' blocks at this path"),
    # its attention splits (sinks with the heads: tests/test_generic_attention_rules.py), its layers' streams do not
    ("hy_v4", "hy_v4: model.layers.0: the decoder layers pass 4 hyper-connection streams (hc_mult), hidden states "
     "[batch, sequence, streams, hidden]; sequence parallelism splits the dimension before hidden"),
])
def test_refused_with_the_module_and_the_reason(registry, arch, message):
    with pytest.raises(ConfigError, match="cannot derive this plan: " + re.escape(message)):
        shards(tiny(arch), registry, 0)
