"""The generic adapter (plait-transformers): plans derived from transformers' declarations, its refusals, and
the registry's precedence of explicit adapters over it. No process group: plans are checked on meta models
with ``plan_layout``; the parity of the derived plans is tests/test_generic_conformance.py."""

from __future__ import annotations

import types

import pytest
import torch

from plait import AdapterError, AdapterInfo, Attention, Column, ConfigError, ParallelConfig, Registry, Row, hookimpl
import plait
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.plugin.registry import served_architectures
from plait.tp.styles import (
    FullWidthNormAttention, FusedColumn, HeadInterleavedAttention, LocalConfigAttention, MoEExperts, ReplicatedGradSum,
    ScaledVocabEmbedding, VocabEmbedding, VocabHead,
)

import plait_transformers
from plait_transformers.tiny import tiny_config
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


def tiny(arch: str, **overrides):
    """The generic adapter's tiny config, without its forward-pass check (plans need only the structure)."""
    config = tiny_config(CONFIG_MAPPING[arch])
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
    ("bert", r"bert is an encoder-only model \(its causal-LM head runs only with is_decoder=true"),
    ("no_such_model", "transformers has no config class for model_type 'no_such_model'"),
])
def test_what_the_generic_adapter_does_not_serve_is_named(registry, model_type, reason):
    with pytest.raises(AdapterError, match=f"no plait adapter claims architecture '{model_type}'.*{reason}"):
        registry.resolve(types.SimpleNamespace(model_type=model_type))


def test_a_causal_lm_without_a_tp_plan_gets_one_from_its_module_tree(registry):
    """Issue 24: data parallelism, ZeRO and pipeline stages need no tp plan, and tp > 1 gets the styles transformers
    declares for the same structures (StableLM: q/k/v/o attention and a gated MLP); softmax attention no rule splits
    is kept whole and run on the whole sequence under SP (JetMoE's mixture of attention heads); GPT-BigCode's
    multi-query fused c_attn is split (q heads per rank, its one kv head replicated); OPT's SP region ends at its
    final norm, which its decoder registers before its layers."""
    for model_type in ("opt", "stablelm", "mamba"):
        assert registry.resolve(types.SimpleNamespace(model_type=model_type)).name == "transformers"
    rules = {type(r).__name__: r.pattern for r in plait_transformers.plait_tp_plan(tiny("stablelm")).rules}
    assert rules["Attention"] == "model.layers.*.self_attn" and rules["Row"] == "model.layers.*.mlp.down_proj"
    assert rules["VocabEmbedding"] == "model.embed_tokens" and rules["VocabHead"] == "lm_head"
    assert plait_transformers.plait_sp_plan(tiny("opt")).end == "model.decoder.final_layer_norm"
    whole = {r.pattern for r in plait_transformers.plait_tp_plan(tiny("jetmoe")).rules
             if type(r).__name__ == "WholeSequence"}
    assert whole == {"model.layers.*.self_attention", "model.layers.*.mlp"}
    assert "model.layers.*.self_attention.kv_proj" in plait_transformers.plait_sp_plan(tiny("jetmoe")).norms
    bigcode = {type(r).__name__: r.pattern for r in plait_transformers.plait_tp_plan(tiny("gpt_bigcode")).rules}
    assert bigcode["Attention"] == "transformer.h.*.attn" and "WholeSequence" not in bigcode


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


def test_gemma3_scaled_embedding_multiplies_by_what_transformers_buffer_holds():
    """The split embedding gives the unsplit module's bits however the model was made: in fp32 and bf16 (the
    buffer's float32 root), made float64 afterwards (that buffer, float32-rounded, now float64: what an image-text
    model made before the float64 check holds) and made under a float64 default (the exact root: what the
    conformance kit's float64 recheck builds, which the rounded value missed by 5e-10 in the loss, failing
    Gemma 4 unified's tp cells); on the meta device the buffer's dtype says which."""
    rule, ids = ScaledVocabEmbedding("model.embed_tokens"), torch.arange(tiny("gemma3_text").vocab_size)[None]
    context = types.SimpleNamespace(mesh=types.SimpleNamespace(tp_group=None))

    def split_and_whole(model):
        module = model.model.embed_tokens
        split = rule.build(rule.shards("model.embed_tokens", module, 1, 0)[0], module, context)
        return split(ids), module(ids)

    made = {"fp32": lambda: AutoModelForCausalLM.from_config(tiny("gemma3_text"))}
    made["bf16"] = lambda: made["fp32"]().to(torch.bfloat16)
    made["fp32, then float64"] = lambda: made["fp32"]().double()
    scales = {}
    for how, make in made.items():
        torch.manual_seed(0)
        model = make()
        split, whole = split_and_whole(model)
        assert torch.equal(split, whole), how
        scales[how] = model.model.embed_tokens.embed_scale.item()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = made["fp32"]()
    finally:
        torch.set_default_dtype(default)
    split, whole = split_and_whole(model)
    assert torch.equal(split, whole)
    exact = tiny("gemma3_text").hidden_size ** 0.5
    assert model.model.embed_tokens.embed_scale.item() == exact != scales["fp32, then float64"]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny("gemma3_text")).model.embed_tokens
    assert rule.scale(meta) == scales["fp32"] and rule.scale(meta.double()) == exact


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


def rules_of(registry, config) -> dict:
    return {r.pattern: r for r in registry.tp_plan(registry.resolve(config), config).rules}


def test_phi3_fused_qkv_and_gate_up_are_split_for_real(registry):
    """transformers gathers qkv_proj and gate_up_proj (colwise_gather_output); plait keeps whole q, k and v
    heads and matching gate / up halves on each rank, and gives the block a config with its head counts."""
    config = tiny("phi3")
    rules = rules_of(registry, config)
    attention, mlp = rules["model.layers.*.self_attn"], rules["model.layers.*.mlp.gate_up_proj"]
    assert isinstance(attention, LocalConfigAttention) and attention.qkv == "qkv_proj"
    assert attention.config_attrs == {"num_attention_heads": "q_heads"}
    assert isinstance(mlp, FusedColumn) and mlp.chunks == 2
    shards = plan(config, registry, tp=2, sp=True).shards_by_rank[1]
    qkv = shards["model.layers.0.self_attn.qkv_proj"]
    assert qkv.weight.ranges == ((16, 32), (40, 48), (56, 64))  # q heads 2-3, kv head 1 of k, of v
    assert qkv.local_attrs["config"].num_attention_heads == 2 and config.num_attention_heads == 4
    assert shards["model.layers.0.mlp.gate_up_proj"].weight.ranges == ((32, 64), (96, 128))


def test_gpt_neox_head_interleaved_qkv(registry):
    rules = rules_of(registry, tiny("gpt_neox"))
    attention = rules["gpt_neox.layers.*.attention"]
    assert isinstance(attention, HeadInterleavedAttention) and (attention.qkv, attention.o) == ("query_key_value", "dense")
    shards = plan(tiny("gpt_neox"), registry, tp=2, sp=True).shards_by_rank[1]
    assert shards["gpt_neox.layers.0.attention.query_key_value"].weight.ranges == ((48, 96),)  # heads 2-3, q k v each


def test_olmo2_full_width_norms_reduce_their_sum_of_squares(registry):
    rules = rules_of(registry, tiny("olmo2"))
    attention = rules["model.layers.*.self_attn"]
    assert isinstance(attention, FullWidthNormAttention) and (attention.q_norm, attention.k_norm) == ("q_norm", "k_norm")
    shards = plan(tiny("olmo2"), registry, tp=4, sp=True).shards_by_rank[3]
    q_norm, k_norm = shards["model.layers.0.self_attn.q_norm"], shards["model.layers.0.self_attn.k_norm"]
    assert q_norm.style.label == "split_rms_norm" and q_norm.weight.ranges == ((24, 32),) and q_norm.grad_sum_block == 1
    assert k_norm.weight.ranges == ((8, 16),) and k_norm.grad_sum_block == 2 and k_norm.style.copies == 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_experts_split_on_the_intermediate_dim_router_replicated(registry, arch):
    config = tiny(arch)
    rules = rules_of(registry, config)
    assert isinstance(rules["model.layers.*.mlp.experts"], MoEExperts)
    assert "model.layers.*.mlp.gate" not in rules
    assert "model.layers.*.mlp.gate" in registry.sp_plan(registry.resolve(config), config).norms  # token-wise
    shard = plan(config, registry, tp=2, sp=True).shards_by_rank[1]["model.layers.0.mlp.experts"]
    inter = config.moe_intermediate_size if arch == "qwen3_moe" else config.intermediate_size
    half = inter // 2
    assert shard.params["gate_up_proj"].ranges == ((half, inter), (inter + half, 2 * inter))
    assert shard.params["down_proj"].dim == 2 and shard.params["down_proj"].ranges == ((half, inter),)


def test_moe_shared_expert_and_dense_layers(registry):
    """ernie4_5_moe: the dense MLP of its first layer is split Column / Row; the shared expert of the MoE
    layers runs on flattened tokens and stays replicated (token-wise: summed over tp under SP)."""
    config = tiny("ernie4_5_moe")
    rules = rules_of(registry, config)
    assert isinstance(rules["model.layers.*.mlp.gate_proj"], Column) and isinstance(rules["model.layers.*.mlp.down_proj"], Row)
    assert not any("shared_experts" in pattern for pattern in rules)
    shards = plan(config, registry, tp=2, sp=True).shards_by_rank[0]
    assert "model.layers.0.mlp.gate_proj" in shards and "model.layers.1.mlp.gate_proj" not in shards
    assert "model.layers.*.mlp.shared_experts.gate_proj" in registry.sp_plan(registry.resolve(config), config).norms


# --------------------------------------------------------------------------------------------------
# Refusals: before any process group, naming the architecture, the module and what is missing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("arch", "layout", "message"), [
    ("nemotron_h", dict(tp=2, sp=False), "nemotron_h: model.layers.*.mixer: model.layers.0.mixer is a "
     "NemotronHMamba2Mixer, where other layers hold the experts: layers of different kinds at one module path"),
    ("doge", dict(tp=2, sp=False), "doge: model.layers.*.self_attn.dt_proj: transformers' style 'rowwise' inside "
     "attention has no plait rule"),
])
def test_refused_before_any_process_group(registry, arch, layout, message):
    with pytest.raises(ConfigError, match="cannot derive this plan: " + message.replace("*", r"\*")):
        plan(tiny(arch), registry, **layout)


@pytest.mark.parametrize("arch", ["nemotron_h"])
def test_refused_plans_still_train_data_parallel(registry, arch):
    """tp=pp=1 needs no plan: an architecture whose tp plan is refused still lays out (and trains) over dp."""
    layout = plan(tiny(arch), registry, tp=1, pp=1, gradient_checkpointing=True)
    assert layout.adapter.name == "transformers" and layout.leaves


# --------------------------------------------------------------------------------------------------
# plait plan --show-derived: the derived plans as an explicit adapter to start from
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["phi3", "olmo2", "gpt_neox", "mixtral", "youtu"])
def test_show_derived_code_loads_as_an_adapter_with_the_same_plans(arch):
    from plait_transformers.derivation import Refusal, derive

    module = types.ModuleType(f"derived_{arch}")
    exec(compile(plait_transformers.show_derived(arch), f"<derived {arch}>", "exec"), module.__dict__)
    registry = Registry(autoload=False)
    adapter = registry.register(module)
    config = plait_transformers.plait_tiny_config(arch)
    assert registry.resolve(config) is adapter and adapter.info.architectures == (arch,)
    derived = derive(config)
    for hook, plan in (("tp_plan", derived.tp), ("sp_plan", derived.sp), ("pipeline_plan", derived.pipeline)):
        if isinstance(plan, Refusal):
            with pytest.raises(ConfigError, match=str(plan).replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
                getattr(registry, hook)(adapter, config)
        else:
            assert getattr(registry, hook)(adapter, config) == plan
    assert registry.leaf_modules(adapter, config) == derived.leaves


def test_plan_show_derived_prints_adapter_code(capsys):
    from plait.cli import main

    main(["plan", "--show-derived", "phi3"])
    out = capsys.readouterr().out
    assert out.startswith('"""plait adapter for phi3, started from the plans plait-transformers derives for Phi3Config')
    assert "FusedColumn(pattern='model.layers.*.mlp.gate_up_proj', chunks=2)" in out
    assert "config_attrs={'num_attention_heads': 'q_heads'}" in out


def test_show_derived_of_an_undeclared_model_type_equals_that_of_its_config(tmp_path):
    """Issue 29: CPM-Ant's SP plan is refused (its position bias, with parameters, goes to the layers beside the
    hidden states), and its model_type starts an adapter as a saved config of it does: the same module but for the
    command line; the SP hook raises why."""
    tiny("cpmant").save_pretrained(tmp_path)
    by_type, by_file = (plait_transformers.show_derived(source).splitlines()
                        for source in ("cpmant", str(tmp_path)))
    assert by_type[1] == "(`plait plan --show-derived cpmant`). Head counts and sizes are this config's."
    assert by_type[:1] + by_type[2:] == by_file[:1] + by_file[2:]
    assert any(line.startswith('    raise ConfigError("cpmant: cpmant.position_bias: has parameters')
               for line in by_type)
    with pytest.raises(ConfigError, match="cannot serve 'bart': bart is an encoder-decoder model"):
        plait_transformers.show_derived("bart")


@pytest.mark.parametrize(("width", "before", "after"), [
    (32, (), ()),  # the default: embeddings as wide as the layers
    (16, ("model.decoder.project_in",), ("model.decoder.project_out",)),
])
def test_pipeline_plan_follows_the_forward_where_transformers_has_no_pp_plan(width, before, after):
    """OPTDecoder registers final_layer_norm (and project_out) before its layers and runs them after: the last
    stage runs them, where by registration order the first stage owned them and later ones passed them by."""
    from plait_transformers.derivation import derive

    plan = derive(tiny("opt", word_embed_proj_dim=width)).pipeline
    assert plan.first == ("model.decoder.embed_tokens", "model.decoder.embed_positions", *before)
    assert plan.layers == "model.decoder.layers"
    assert plan.last == ("model.decoder.final_layer_norm", *after, "lm_head")
    assert plan.neutralize == ("model.decoder.embed_positions", *before)
    # NanoChat (no pp plan either) also runs its final norm on the embeddings: still the last stage's
    assert derive(tiny("nanochat")).pipeline.last == ("model.norm", "lm_head")


class _NormBothSides(torch.nn.Module):
    """A decoder whose one norm, with parameters, runs before and after its layers (NanoChat's has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4)
        self.layers = torch.nn.ModuleList([torch.nn.Identity()])

    def forward(self, ids):
        hidden = self.norm(self.embed(ids))
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


def test_pipeline_plan_refuses_a_norm_with_parameters_on_both_sides_of_the_layers():
    """The stage owning it would be the last; the first would pass it by: refused, not silently wrong."""
    from plait_transformers.pipeline_stages import pipeline_plan

    model = torch.nn.Module()
    model.model, model.pp_plan = _NormBothSides(), None
    with pytest.raises(ConfigError, match="model.norm: the forward uses it both before and after the layers"):
        pipeline_plan(model, "toy", "model.layers")


def test_show_derived_says_what_is_proven(tmp_path, monkeypatch):
    """The docstring lists the modes the architecture sweep recorded for the generic adapter's plans, at its
    transformers version; an architecture swept only with an explicit adapter, or never, is unproven, and so is
    every refused plan."""
    sweep = tmp_path / "architectures.md"
    sweep.write_text("Written by `scripts/architecture_sweep.py` (transformers 9.9.9, torch 2.13.0).\n\n"
                     "| architecture | adapter | tp2-sp | pp2-1f1b | cp2 |\n| --- | --- | --- | --- | --- |\n"
                     "| qwen3 | transformers | FAIL (grad \\| 2) | pass (loss 0e+00) | refused: no |\n"
                     "| phi3 | phi3-own | pass | pass | pass |\n")
    monkeypatch.setattr(plait_transformers, "SWEEP_RESULTS", sweep)
    text = " ".join(plait_transformers.show_derived("qwen3").split())
    assert ("the tiny qwen3 config, as scripts/architecture_sweep.py recorded it in docs/architectures.md at "
            "transformers 9.9.9 (installed: transformers") in text
    assert "whose plans may differ): failed tp2-sp; passed pp2-1f1b; refused cp2. Unproven: any other config" in text
    for arch in ("phi3", "cpmant"):
        text = " ".join(plait_transformers.show_derived(arch).split())
        assert f"Unproven: docs/architectures.md records no conformance-kit run of the generic adapter's plans for " \
               f"{arch}. Add a plait_tiny_config hook, then run `plait check-adapter <this module>`." in text
    assert "# unproven: write this plan, then run `plait check-adapter <this module>` @hookimpl def plait_sp_plan" \
        in text


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
    with pytest.raises(ConfigError, match="cannot serve 'bert': bert is an encoder-only model"):
        plait_transformers.plait_tiny_config("bert")


def test_tiny_config_that_cannot_run_or_is_not_tiny_is_refused():
    with pytest.raises(ConfigError, match="the tiny qwen3 config values derived from Qwen3Config's defaults do not run "
                                          "one forward pass"):
        plait_transformers.checked(tiny("qwen3", num_key_value_heads=3))
    with pytest.raises(ConfigError, match="still has 6,437,216 parameters"):
        plait_transformers.checked(tiny("qwen3", vocab_size=100_000))
