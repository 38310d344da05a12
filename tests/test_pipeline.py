"""Pipeline parallelism: stage cuts, refusals, layout, and parity against one process (gloo, fp32).

Multi-process checks share two launches (a world of 2 and one of 4, see workers/pipeline_parity.py);
everything that needs no process group runs here in-process on tiny or meta models.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from plait import ConfigError, ParallelConfig, PipelinePlan, Registry, parallelize
from plait.layout_plan import pipeline_layout, plan_layout
from plait.pipeline import rank_of_stage, stage_bytes, stages_of_rank
from plait.pipeline.cuts import balance, fallback_plan
from plait.testing import launch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from pipeline_parity import CHECKS, build  # noqa: E402
from tiny_decoder import TinyAdapter, TinyConfig, TinyDecoder  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "pipeline_parity.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    merged: dict[str, list[dict]] = {}
    for tag, world in (("w2", 2), ("w4", 4)):
        out = tmp_path_factory.mktemp(tag) / "results.json"
        launch([WORKER, str(out), tag], world, timeout=400)
        merged.update(json.loads(out.read_text()))
    return merged


PARITY = [name for world in CHECKS.values() for name, (fn, *_) in world.items() if fn.__name__ == "parity"]
TIED = {"gpt2", "llama_tied"}
REPLICATED = {"gemma4"}  # per-layer embeddings (and the input embedding they read) on every stage
# Parameters after 3 AdamW steps at lr 1e-3: Adam divides by sqrt(v) + 1e-8, so on entries whose gradient is itself
# near 1e-8 a gradient difference at fp32's noise floor moves the update by a few percent of lr (measured 4.7e-5 on
# custom-fallback-padding, whose gradients all agree within atol 1e-6). An update lost or applied twice on any
# rank or stage is off by about lr (1e-3) on every entry it touches: 10x above this bound.
PARAM_TOL = 1e-4


@pytest.mark.parametrize("check", PARITY)
def test_parity(results, check):
    arch = next(args[1] for world in CHECKS.values() for name, args in world.items() if name == check)
    for rank, r in enumerate(results[check]):
        where = f"{check} rank {rank} (stages {r['stages']}): losses plait/reference per step {r['losses']}"
        assert r["loss_rel"] <= TOL, f"{where}: loss off by {r['loss_rel']:.2e} relative"
        assert r["grads_close"], f"{where}: gradients off by up to {r['grad_abs']:.2e} (rtol 1e-5, atol 1e-6)"
        assert r["eval_rel"] <= TOL, f"{where}: eval_loss off by {r['eval_rel']:.2e} relative"
        assert r["norm_rel"] <= TOL, f"{where}: global gradient norm off by {r['norm_rel']:.2e} relative"
        assert r["param_abs"] <= PARAM_TOL, f"{where}: parameters after the steps off by up to {r['param_abs']:.2e}"
        if arch in TIED and r["tied_diff"] is not None:
            assert r["tied_diff"] == 0.0, f"{where}: tied embedding copies differ by {r['tied_diff']}"
    if arch in TIED:
        assert any(r["tied_diff"] is not None for r in results[check]), f"{check}: no rank held a tied copy"
    if arch in REPLICATED:  # every stage's copy took the same steps
        assert all(r["replicated_diff"] == 0.0 for r in results[check]), \
            f"{check}: every-stage copies differ by {[r['replicated_diff'] for r in results[check]]}"
    # every parameter's gradient compared at every step on the stage that holds it
    compared = set().union(*(r["checked"] for r in results[check]))
    assert compared >= set(results[check][0]["parameters"]), f"{check}: never compared " \
        f"{sorted(set(results[check][0]['parameters']) - compared)}"


def test_meta_model_never_materialises_other_stages(results):
    for rank, r in enumerate(results["meta-llama"]):
        assert r["foreign_with_storage"] == [], f"rank {rank} kept modules of other stages: {r['foreign_with_storage']}"
        assert r["held_bytes"] == r["layout_bytes"], \
            f"rank {rank}: holds {r['held_bytes']} B of parameters, the layout says {r['layout_bytes']} B"
        assert r["loss_rel"] <= TOL
    assert results["meta-llama"][0]["owned"] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert results["meta-llama"][1]["owned"] == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]


def test_refusals_in_a_world_raise_on_every_rank_before_any_collective(results):
    for rank, r in enumerate(results["refusals"]):
        assert "needs virtual_pipeline_size >= 2" in r["parallelize"], f"rank {rank}: {r}"
        assert "batch of 6 sequences is not divisible by num_microbatches=4" in r["train_step"], f"rank {rank}: {r}"
        assert r["after"] > 0  # the world kept working: no rank was left inside a collective


# -- in-process: cuts, layout, refusals --------------------------------------------------------------


def meta_llama(layers: int = 4, vocab: int = 61, **kwargs) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, **kwargs))


def test_layout_of_a_meta_llama():
    rows = pipeline_layout(meta_llama(), ParallelConfig(pp=2, num_microbatches=2))
    stages = {name: stage for name, stage, _ in rows}
    assert stages == {"model.embed_tokens": 0, "model.rotary_emb": None, "model.layers.0": 0, "model.layers.1": 0,
                      "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    sizes = {name: size for name, _, size in rows}
    assert sizes["model.embed_tokens"] == 61 * 32 * 4 and sizes["model.rotary_emb"] == 0
    assert stage_bytes(rows) == {0: sum(sizes[n] for n, s in stages.items() if s == 0),
                                 1: sum(sizes[n] for n, s in stages.items() if s == 1)}


def test_tied_weight_counts_on_both_ends():
    rows = pipeline_layout(meta_llama(tie_word_embeddings=True), ParallelConfig(pp=2, num_microbatches=2))
    sizes = {name: (stage, size) for name, stage, size in rows}
    assert sizes["model.embed_tokens"] == (0, 61 * 32 * 4) and sizes["lm_head"] == (1, 61 * 32 * 4)


def test_per_layer_inputs_are_held_by_every_stage_and_summed_over_the_pipeline():
    """Gemma's per-layer embeddings (and the input embedding their projection reads, tied to the LM head) are
    computed by every stage from the token ids: every stage holds them, and their gradients are summed over the
    whole pipeline (``LayoutPlan.replicated``), not over its two ends as a tied weight's."""
    model = build("gemma4", device="meta")
    config = ParallelConfig(pp=2, num_microbatches=2)
    plan = plan_layout(model, config, world_size=2)
    assert plan.split.plan.token_ids and plan.tied == ()
    every = ("model.embed_tokens", "model.embed_tokens_per_layer", "model.per_layer_model_projection",
             "model.per_layer_projection_norm")
    assert set(plan.replicated) == {f"{name}.weight" for name in every} | {"lm_head.weight"}
    rows = pipeline_layout(model, config)
    stages = {name: stage for name, stage, _ in rows}
    assert all(stages[name] is None for name in every) and stages["lm_head"] == 1
    sizes = {name: size for name, _, size in rows}
    held = sum(sizes[name] for name in every)
    assert stage_bytes(rows) == {s: held + sum(sizes[n] for n, at in stages.items() if at == s) for s in (0, 1)}


def test_balance_counts_embedding_and_head_parameters():
    assert balance([10] * 6, first_cost=25, last_cost=0, num_stages=2) == [(0, 2), (2, 6)]
    assert balance([10] * 6, first_cost=0, last_cost=0, num_stages=3) == [(0, 2), (2, 4), (4, 6)]
    # a vocabulary worth several layers pushes layers off both end stages
    rows = pipeline_layout(meta_llama(layers=6, vocab=1024), ParallelConfig(pp=3, num_microbatches=3))
    per_stage = [sum(1 for name, s, _ in rows if s == stage and ".layers." in name) for stage in range(3)]
    assert per_stage[1] > per_stage[0] and per_stage[1] > per_stage[2], per_stage


def test_user_cuts_end_a_stage_after_the_named_leaf_module():
    rows = pipeline_layout(meta_llama(), ParallelConfig(pp=2, num_microbatches=2, pipeline_cuts=("model.layers.2",)))
    assert [name for name, stage, _ in rows if stage == 1] == ["model.layers.3", "model.norm", "lm_head"]


def test_virtual_stages_are_looped():
    rows = pipeline_layout(meta_llama(), ParallelConfig(pp=2, virtual_pipeline_size=2, num_microbatches=2,
                                                        pipeline_schedule="interleaved-1f1b"))
    assert [stage for name, stage, _ in rows if ".layers." in name] == [0, 1, 2, 3]
    assert [rank_of_stage(stage, 2) for stage in range(4)] == [0, 1, 0, 1]
    assert stages_of_rank(1, ParallelConfig(pp=2, virtual_pipeline_size=2)) == [1, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=2, virtual_pipeline_size=3, pipeline_schedule="interleaved-1f1b", num_microbatches=2),
     "4 layers cannot fill 6 pipeline stages (pp*virtual_pipeline_size = 2*3)"),
    (dict(pp=2, pipeline_schedule="interleaved-1f1b", num_microbatches=2), "needs virtual_pipeline_size >= 2 (got 1)"),
    (dict(pp=2, virtual_pipeline_size=2, pipeline_schedule="1f1b", num_microbatches=2),
     "runs one stage per rank but virtual_pipeline_size=2"),
    (dict(pp=4, num_microbatches=2), "needs num_microbatches >= pp, got num_microbatches=2 < pp=4"),
    (dict(pp=2, num_microbatches=1, pipeline_schedule="zero-bubble"), "num_microbatches=1 < pp=2"),
    (dict(pp=2, virtual_pipeline_size=2, num_microbatches=5, pipeline_schedule="interleaved-1f1b"),
     "num_microbatches=5 is not a multiple of its 2 rounds"),
    (dict(pp=2, num_microbatches=2, pipeline_cuts=("model.layers.0", "model.layers.1")),
     "pipeline_cuts has 2 cut(s) but pp*virtual_pipeline_size = 2*1 needs 1"),
    (dict(pp=2, num_microbatches=2, pipeline_cuts=("model.norm",)),
     "'model.norm' is not a leaf module a stage can end after"),
    (dict(pp=2, num_microbatches=2, pipeline_cuts=("model.layers.3",)), "'model.layers.3' is not a leaf module"),
    (dict(pp=3, num_microbatches=3, pipeline_cuts=("model.layers.2", "model.layers.1")),
     "must name distinct leaf modules in model order"),
])
def test_refusals_name_the_numbers(kwargs, message):
    with pytest.raises(ConfigError) as err:
        pipeline_layout(meta_llama(), ParallelConfig(**kwargs))
    assert message in str(err.value)


def tiny_registry() -> Registry:
    registry = Registry(autoload=False)
    registry.register(TinyAdapter())
    return registry


def test_fallback_plan_from_leaf_modules():
    with torch.device("meta"):
        model = TinyDecoder(TinyConfig())
    assert fallback_plan(model, ["blocks.*"]) == PipelinePlan(first=("embed",), layers="blocks", last=("norm", "head"))
    # on Llama the fallback finds the rotary tables after the layers: parameter-free, so every stage runs them
    assert fallback_plan(meta_llama(), ["model.layers.*"]) == PipelinePlan(
        first=("model.embed_tokens",), layers="model.layers", last=("model.norm", "model.rotary_emb", "lm_head"))
    rows = pipeline_layout(model, ParallelConfig(pp=2, num_microbatches=2), tiny_registry())
    assert [(name, stage) for name, stage, _ in rows] == [
        ("embed", 0), ("blocks.0", 0), ("blocks.1", 0), ("blocks.2", 1), ("blocks.3", 1), ("norm", 1), ("head", 1)]


def test_fallback_refuses_leaves_outside_one_module_list():
    with torch.device("meta"):
        model = TinyDecoder(TinyConfig())
    with pytest.raises(ConfigError, match="do not select the children of one nn.ModuleList"):
        fallback_plan(model, ["blocks.*.fc1"])


def test_weights_tied_across_middle_stages_are_refused():
    with torch.device("meta"):
        model = TinyDecoder(TinyConfig())
    model.blocks[0].fc1.weight = model.blocks[1].fc1.weight
    config = ParallelConfig(pp=3, num_microbatches=3, pipeline_cuts=("blocks.0", "blocks.1"))
    with pytest.raises(ConfigError, match=r"shared by pipeline stages \[0, 1\]"):
        pipeline_layout(model, config, tiny_registry())


def test_pp1_train_step_is_microbatched_forward_backward():
    model = build("llama")
    ref = copy.deepcopy(model)
    pm = parallelize(model, ParallelConfig(num_microbatches=4))
    ids = torch.randint(3, 61, (8, 16), generator=torch.Generator().manual_seed(0))
    loss = pm.train_step(ids, ids)
    logits = ref(input_ids=ids).logits
    ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, 61), ids[:, 1:].reshape(-1))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=TOL, atol=0)
    for name, param in pm.module.named_parameters():
        torch.testing.assert_close(param.grad, ref.get_parameter(name).grad, rtol=TOL, atol=1e-6)
    with pytest.raises(ConfigError, match="batch of 6 sequences is not divisible by num_microbatches=4"):
        pm.train_step(ids[:6], ids[:6])
