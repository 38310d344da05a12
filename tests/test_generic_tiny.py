"""Single-process checks of what the generic adapter's tiny configs and plans need beyond the plans themselves:
persistent buffers (a router's ``e_score_correction_bias``) through save / load / consolidate / a model directory,
tiny configs of architectures whose defaults do not shrink on their own, and pipeline placeholders that keep the
attributes transformers' forwards read off every layer. Parity of the architectures under tp / pp is shown by
scripts/architecture_sweep.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from plait import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.checkpoint import consolidate, load_checkpoint, save_checkpoint
from plait.checkpoint.materialize import load_parallel_model
from plait.checkpoint.state import persistent_buffers
from plait.pipeline.stages import PassThrough
from plait_transformers import plait_tiny_config, plait_tp_plan
from plait_transformers.derivation import Refusal, derive

from releases import needs_model_type

BIAS = "e_score_correction_bias"


def _set_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Distinct non-zero values in every router bias (as a trained DeepSeek-V3-style checkpoint holds)."""
    found = {n: b for n, b in persistent_buffers(model).items() if n.endswith(BIAS)}
    with torch.no_grad():
        for i, buffer in enumerate(found.values()):
            buffer.copy_(torch.arange(buffer.numel(), dtype=buffer.dtype).view_as(buffer) * 0.25 + i)
    return {n: b.clone() for n, b in found.items()}


def test_persistent_buffers_round_trip_through_checkpoint_consolidate_and_model_dir(tmp_path):
    config = plait_tiny_config("glm4_moe")
    pmodel = load_parallel_model(config, ParallelConfig(), seed=3)
    biases = _set_biases(pmodel.module)
    assert len(biases) >= 2, "the tiny glm4_moe config should have routed layers with a router bias"

    path = save_checkpoint(tmp_path / "checkpoint-1", pmodel, step=1)
    out = consolidate(path, tmp_path / "hf")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = loaded.state_dict()
    for name, value in biases.items():
        assert torch.equal(state[name], value), name

    resumed = load_parallel_model(path, ParallelConfig(), seed=7)  # the lazy path: buffers read with the weights
    fresh = load_parallel_model(config, ParallelConfig(), seed=7)
    load_checkpoint(path, fresh)  # resume into a built model
    from_dir = load_parallel_model(out, ParallelConfig(), seed=7)  # a from_pretrained directory
    for model in (resumed, fresh, from_dir):
        found = persistent_buffers(model.module)
        for name, value in biases.items():
            assert torch.equal(found[name], value), name
        for (name, a), b in zip(model.module.named_parameters(), pmodel.module.parameters()):
            assert torch.equal(a, b), name


# Tiny configs the derivation had to learn: per-layer overrides keyed by layer index (per_layer_config), layer
# kinds placed by period and offset, sizes of more keys, and a small table of class defaults that do not run.
BUILT = ["axk2", "bailing_hybrid", "blt", "cohere_compass_text", "deepseek_v32", "deepseek_v4", "dory", "dots1",
         "dots3_note", "dots3_note_text", "emu3", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm_moe_dsa",
         "granitemoehybrid", "hrm_text", "jamba", "kimi_linear", "lfm2_moe", "llama4", "longcat_flash", "mllama",
         "phi4_multimodal", "qwen4_exp_text", "xlstm", "zaya"]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=needs_model_type(a, "5.24")) if a == "dory" else a for a in BUILT])
def test_tiny_config_builds_and_runs_one_forward(arch):
    config = plait_tiny_config(arch)  # checked: builds, stays small, runs one forward pass
    per_layer = getattr(config, "per_layer_config", None)
    if isinstance(per_layer, dict):
        assert all(0 <= int(i) < config.num_hidden_layers for i in per_layer), per_layer


@needs_model_type("dory", "5.24")
def test_dory_tiny_config_loops_both_attention_kinds_between_one_input_and_one_output_layer():
    config = plait_tiny_config("dory")  # the class halves the released attention+mlp block counts it is given
    assert (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers) == (1, 2, 1)
    assert set(config.layer_types[1:3]) == {"sliding_attention", "full_attention"}


@pytest.mark.parametrize("arch, text_type", [("emu3", "emu3_text_model"), ("mllama", "mllama_text_model")])
def test_a_text_config_built_only_under_its_composite_type_builds_and_loads_again(tmp_path, arch, text_type):
    from plait.base.meta import causal_lm_refusal

    model = AutoModelForCausalLM.from_config(plait_tiny_config(arch))  # transformers builds it from the text config
    assert model.config.model_type == text_type and causal_lm_refusal(model.config) is None
    assert type(build_meta_model(model.config)) is type(model)
    model.save_pretrained(tmp_path)  # what a consolidated checkpoint holds: the text config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_a_draft_model_is_refused_in_one_line_saying_it_needs_the_target_models_states(arch):
    with pytest.raises(ConfigError, match=f"cannot serve '{arch}': {arch} is a speculative-decoding draft model: "
                                          f".*shared_kv_states") as err:
        plait_tiny_config(arch)
    assert "\n" not in str(err.value)


def test_a_config_transformers_cannot_build_is_a_one_line_refusal_naming_the_architecture():
    config = plait_tiny_config("qwen3")
    config.hidden_act = "no_such_activation"  # transformers raises a KeyError building the MLP
    derived = derive(config)
    for plan in (derived.tp, derived.sp, derived.pipeline):
        assert isinstance(plan, Refusal)
        assert str(plan).startswith("qwen3: Qwen3Config: transformers cannot build the model: KeyError")
        assert "\n" not in str(plan)
    with pytest.raises(ConfigError, match="cannot derive this plan: qwen3: Qwen3Config"):
        plait_tp_plan(config)


def test_a_tiny_config_the_class_rejects_is_a_one_line_refusal(monkeypatch):
    import plait_transformers

    monkeypatch.setattr(plait_transformers, "tiny_config", lambda cls: cls(hidden_size=30, num_attention_heads=4,
                                                                          head_dim=None))
    with pytest.raises(ConfigError, match=r"^the tiny qwen3 config values derived from Qwen3Config's defaults") as err:
        plait_tiny_config("qwen3")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch, attribute", [("nemotron_h", "block_type"), ("inkling2_text", "attention_type")])
def test_pipeline_placeholder_keeps_the_attributes_the_forward_reads_off_every_layer(arch, attribute):
    layer = build_meta_model(plait_tiny_config(arch)).model.layers[1]
    placeholder = PassThrough(layer)
    assert getattr(placeholder, attribute) == getattr(layer, attribute)
    assert not list(placeholder.parameters()) and not list(placeholder.children())
    hidden = torch.ones(1, 2, 3)
    assert placeholder(hidden) is hidden


def test_a_final_norm_also_run_before_the_layers_ends_no_sequence_parallel_region():
    sp = derive(plait_tiny_config("nanochat")).sp  # NanoChat normalises the embeddings with its final norm
    assert sp.end == "model.layers.3" and "model.norm" not in sp.norms
    assert derive(plait_tiny_config("qwen3")).sp.end == "model.norm"


def test_a_layer_input_threaded_from_layer_to_layer_refuses_pipeline_stages():
    derived = derive(plait_tiny_config("inkling2_text"))  # each layer also takes the earlier blocks' outputs
    assert isinstance(derived.pipeline, Refusal) and "\n" not in str(derived.pipeline)
    assert str(derived.pipeline).startswith("inkling2_text: model.layers: ") and "['block_states']" in str(derived.pipeline)
    assert not isinstance(derive(plait_tiny_config("nemotron_h")).pipeline, Refusal)


@pytest.mark.parametrize("arch, plan, words", [
    pytest.param("dory", "pipeline", "inside another loop",  # its recurrent middle layers run several times per forward
                 marks=needs_model_type("dory", "5.24")),
    ("longcat_flash", "tp", "identity (zero-compute) experts"),  # would be added once per tp rank
    ("hrm_text", "sp", "runs its 4 layers 32 times"),  # HRM's cycles would split the sequence on every run
])
def test_what_the_layouts_cannot_split_is_refused_in_one_line(arch, plan, words):
    refusal = getattr(derive(plait_tiny_config(arch)), plan)
    assert isinstance(refusal, Refusal) and str(refusal).startswith(f"{arch}: ") and "\n" not in str(refusal)
    assert words in str(refusal)


def test_an_index_config_with_infinity_reads_back():
    import json

    from plait.checkpoint.format import Index, model_config

    config = plait_tiny_config("granitemoehybrid")  # time_step_limit (0.0, inf), written as {"__float__": ...}
    index = Index(step=0, model_type=config.model_type, model_config=json.loads(config.to_json_string()),
                  parallel_config={}, world_size=1, tensors={}, files={})
    assert tuple(model_config(index).time_step_limit) == (0.0, float("inf"))
