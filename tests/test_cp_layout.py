"""Context parallelism before launch: the load-balanced split, the strategy choice, and every refusal (one
process, meta models: no group, no weight)."""

from __future__ import annotations

import pytest
import torch

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.cp.layout import RING_FROM
from plait.cp.sequence import chunk_bounds, local_index, natural_order, read_spans
from plait.layout_plan import plan_layout
from plait.run.train_args import TrainArgs
from plait.testing.conformance_modes import load_subject, with_overrides


def plan(subject: str, world: int, overrides: dict | None = None, **layout):
    s = load_subject(subject)
    return plan_layout(build_meta_model(with_overrides(s.config, overrides or {})), ParallelConfig(**layout), world,
                       s.registry)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_split_is_balanced_and_invertible(size):
    seq = 16 * size
    held = [local_index(seq, size, r) for r in range(size)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))  # every token on exactly one rank
    assert torch.equal(torch.cat(held)[natural_order(seq, size)], torch.arange(seq))
    work = [int((index + 1).sum()) for index in held]  # causal attention: token t attends to t + 1 keys
    assert len(set(work)) == 1, work  # chunks i and 2C-1-i: the same work on every rank
    for r in range(size):
        (a, b), (c, d) = chunk_bounds(seq, size, r)
        assert read_spans(seq, size, r) == [(a, b + 1), (c, min(d + 1, seq))]


def test_layout_values_are_checked():
    with pytest.raises(ConfigError, match="cp=0 must be a positive integer"):
        ParallelConfig(cp=0)
    with pytest.raises(ConfigError, match="cp_attention='ulysses' is unknown; choose one of auto, all-to-all, ring"):
        ParallelConfig(cp=2, cp_attention="ulysses")
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp\*cp\*pp = 2\*2\*1 = 4"):
        ParallelConfig(tp=2, cp=2).resolve(6)
    assert ParallelConfig(tp=2, cp=2).resolve(8).dp == 2
    assert "cp=2 (ring)" in ParallelConfig(cp=2, cp_attention="ring").resolve(2).describe()


def test_unknown_strategy_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="--cp_attention='ulysses' is unknown; choose one of auto, all-to-all, ring"):
        TrainArgs(output_dir=str(tmp_path), cp_attention="ulysses").validate()


def test_block_size_must_cut_into_2c_chunks(tmp_path):
    args = TrainArgs(output_dir=str(tmp_path), block_size=18, context_parallel_size=2)
    with pytest.raises(ConfigError, match="sequence length 18 is not divisible by 2\\*cp = 4; use a block size that is a "
                                          "multiple of 4"):
        args.validate()
    args = TrainArgs(output_dir=str(tmp_path), block_size=20, context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="not divisible by 2\\*cp = 4 \\(and by tp=2 under sequence parallelism\\); "
                                          "use a block size that is a multiple of 8"):
        args.validate()


def test_auto_takes_all_to_all_where_heads_allow_and_ring_beyond_it():
    both = plan("llama", 2, cp=2).cp  # 4 heads over 2 ranks, no attention dropout
    assert both.strategy_for(4096) == "all-to-all" and both.strategy_for(2 * RING_FROM) == "ring"
    eight = plan("llama", 8, cp=8).cp  # 4 heads cannot split over 8 ranks
    assert eight.strategy_for(64) == "ring" and "4 / tp=1 = 4" in eight.all_to_all_refusal
    with pytest.raises(ConfigError, match=r"cp_attention=all-to-all: all-to-all needs the attention heads of a tp rank "
                                          r"\(4 / tp=2 = 2\) to divide by cp=4; use cp_attention=ring \(or auto, which "
                                          r"picks it\)$"):
        plan("llama", 8, cp=4, tp=2, cp_attention="all-to-all")


def test_attention_dropout_keeps_the_ring_out():
    dropout = plan("llama", 2, {"attention_dropout": 0.1}, cp=2).cp
    assert dropout.strategy_for(2 * RING_FROM) == "all-to-all"
    with pytest.raises(ConfigError, match=r"cp_attention=ring: the ring has no exact attention dropout "
                                          r"\(attention_dropout=0.1\); set it to 0; use cp_attention=all-to-all"):
        plan("llama", 2, {"attention_dropout": 0.1}, cp=2, cp_attention="ring")
    with pytest.raises(ConfigError, match="to divide by cp=8, and the ring has no exact attention dropout .*; "
                                          "use cp=1$"):
        plan("llama", 8, {"attention_dropout": 0.1}, cp=8)


def test_sinks_keep_all_to_all_out():
    sinks = plan("transformers:gpt_oss", 2, cp=2).cp
    assert sinks.strategy_for(64) == "ring" and "self_attn.sinks (per-head attention sinks)" in sinks.all_to_all_refusal


@pytest.mark.parametrize("subject, overrides, message", [
    ("transformers:qwen3_next", {}, "layer type 'linear_attention' (config.layer_types) carries state along the "
                                    "sequence, which context parallelism cannot split exactly; use cp=1"),
    ("transformers:lfm2_moe", {}, "layer type 'conv' (config.layer_types) carries state along the sequence"),
    ("transformers:doge", {}, "DogeForCausalLM works on the attention mask itself (modeling_doge.py:"),
    ("transformers:bloom", {}, "transformer.h.0.self_attention (BloomAttention) computes attention itself, not through "
                               "transformers' attention functions"),
    ("transformers:gpt_neo", {}, "transformer.h.0.attn.attention (GPTNeoSelfAttention) computes attention itself"),
    ("transformers:blt", {}, "model.local_encoder.cross_attn_layers.0 (BltCrossAttention) is cross-attention: its "
                             "keys and values come from another sequence"),
])
def test_what_cp_cannot_match_is_refused_naming_it(subject, overrides, message):
    with pytest.raises(ConfigError) as err:
        plan(subject, 2, overrides, cp=2)
    assert message in str(err.value)


def test_cp_needs_no_adapter_hook_and_leaves_the_plan_at_cp1():
    assert plan("llama", 1).cp is None
    assert plan("gpt2", 4, cp=2, tp=2).cp.size == 2


def test_router_loss_needs_router_logits_to_gather(monkeypatch):
    assert plan("transformers:mixtral", 2, {"output_router_logits": True}, cp=2).cp is not None  # gathered
    import plait.cp.layout

    monkeypatch.setattr(plait.cp.layout, "router_recorders", lambda model: [])  # a model that records none
    with pytest.raises(ConfigError, match="MixtralForCausalLM records no router logits plait can gather over cp"):
        plan("transformers:mixtral", 2, {"output_router_logits": True}, cp=2)


def test_composite_gemma4_masks_are_built_over_the_whole_sequence():
    """Gemma 4's multimodal models build every layer type's mask at once through masking_utils'
    create_masks_for_generate, which calls masking_utils' own builders: it is wrapped like them, so its masks are
    built over the whole sequence (and its block ids, all -1 in a text forward, stand for the whole sequence)."""
    assert plan("transformers:gemma4", 2, cp=2).cp is not None
    assert plan("transformers:gemma4_unified", 2, cp=2).cp is not None


def test_a_mask_built_from_the_local_slice_is_refused_naming_the_builder(monkeypatch):
    """Before create_masks_for_generate was wrapped, Gemma 4's masks were built from each rank's slice (the dry run
    swallowed it and cp2 failed at its first step): such a builder is refused before launch, named."""
    import transformers.masking_utils
    from transformers.models.gemma4 import modeling_gemma4

    import plait.cp.masks

    original = plait.cp.masks._is_builder
    monkeypatch.setattr(plait.cp.masks, "_is_builder",
                        lambda value: original(value) and "create_masks_" not in getattr(value, "__name__", ""))
    monkeypatch.setattr(modeling_gemma4, "create_masks_for_generate",
                        transformers.masking_utils.create_masks_for_generate)
    with pytest.raises(ConfigError, match=r"Gemma4ForConditionalGeneration builds an attention mask from this rank's "
                                          r"slice of the sequence \(modeling_gemma4.py:\d+, in forward\), through "
                                          r"create_masks_for_generate of transformers.masking_utils"):
        plan("transformers:gemma4", 2, cp=2)


def test_attention_handed_a_mask_plait_did_not_build_is_refused_naming_it(monkeypatch):
    """A model building some mask of its own for an attention call (here: Llama's attention handed a tensor) is
    refused naming the attention module."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaDecoderLayer.forward

    def own_mask(self, *args, **kwargs):
        kwargs["attention_mask"] = torch.ones(1, 1, 8, 8, dtype=torch.bool, device="meta")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", own_mask)
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn \(LlamaAttention\): .*LlamaAttention was handed a "
                                          r"Tensor mask, not one plait built over the whole sequence"):
        plan("llama", 2, cp=2)


def test_the_dry_run_runs_past_routed_experts_and_lets_other_errors_through(monkeypatch):
    """Routed experts (transformers' routing contract, DBRX's own experts too) run as a shape-only stand-in on the
    meta device, so the dry run reaches the head; JetMoE's gating reads its token counts (no value on meta): the dry
    run ends there. An error of any other kind is not swallowed."""
    from plait.cp.dry_run import check_on_meta

    for subject in ("transformers:qwen3_moe", "transformers:dbrx", "transformers:longcat_flash"):
        model = build_meta_model(load_subject(subject).config)
        reached = []
        model.get_output_embeddings().register_forward_hook(lambda *args: reached.append(True))
        check_on_meta(model)
        assert reached, subject
    check_on_meta(build_meta_model(load_subject("transformers:jetmoe").config))
    model = build_meta_model(load_subject("llama").config)

    def broken(*args, **kwargs):
        raise ValueError("a bug of the model's")

    model.model.norm.forward = broken
    with pytest.raises(ValueError, match="a bug of the model's"):
        check_on_meta(model)


def test_the_dry_run_runs_once_per_model_while_it_stays_the_same(monkeypatch):
    """Its verdict is the model's (a group of one, whatever the layout), so planning many cp layouts of one model (a
    search) runs it once; a refusal is given again each time; a model changed since (its config here) runs again."""
    import plait.cp.dry_run as dry_run

    runs = []
    monkeypatch.setattr(dry_run, "_run_on_meta", lambda model: runs.append(model))
    model = build_meta_model(load_subject("llama").config)
    for _ in range(3):
        dry_run.check_on_meta(model)
    assert len(runs) == 1
    model.config.rms_norm_eps = 1e-3
    dry_run.check_on_meta(model)
    assert len(runs) == 2

    def refuse(model):
        runs.append(model)
        raise ConfigError("LlamaForCausalLM works on the attention mask itself")

    monkeypatch.setattr(dry_run, "_run_on_meta", refuse)
    other = build_meta_model(load_subject("llama").config)
    for _ in range(2):
        with pytest.raises(ConfigError, match="works on the attention mask itself"):
            dry_run.check_on_meta(other)
    assert len(runs) == 3
