"""Issue 24: more causal LMs through the generic adapter, each with one-process parity (the kit's 3 AdamW steps,
fp32), where before they were refused:

- decoder layers found in the module tree where transformers declares neither a pp plan nor
  ``_no_split_modules`` (BERT-Generation, BioGPT, CTRL, GIT, GPT-1): pipeline stages, staged by each module
  holding the layer list (BERT's embeddings block by its children), and a sequence-parallel region that ends at
  the last layer where there is no final norm (post-norm layers);
- an MLP written on the decoder layer itself as ``fc2(act(fc1(x)))`` (XGLM, TrOCR, BioGPT; OPT on the hidden
  states flattened to [tokens, hidden]): fc1 column-, fc2 row-parallel, as a block of its own would be;
- modules staged in the order the forward runs them where transformers' pp plan leaves one out or there is
  none (Phi-4-multimodal's embedding extension, ModernBERT-decoder's prediction head before the LM head, which
  keeps that head replicated: a vocab-parallel one would hand the prediction head a split gradient);
- composites whose head counts live in their text config (Llama4, Qwen3.5, Qwen3.5-MoE) split over tp;
- tiny configs that now shrink and run, from the config classes' own rules (sizes the class derives itself, a
  rotary width no wider than a head, Mamba widths of heads x head size, sub-configs declared as AutoConfig):
  CodeGen, GPT-J, XLNet, Falcon-H1, Bamba, RecurrentGemma, Zamba, Zamba2, Gemma3, Fuyu, GOT-OCR2,
  MOSS-Transcribe-Diarize, whose vision or audio encoder (used only by ``get_image_features`` and the like) the
  first pipeline stage holds;
- decoder layers whose return the model unpacks (Bamba's ``hidden_states, attn_weights = layer(...)``, RWKV's
  ``hidden_states, state, attentions``, its state a cache that stays None without ``use_cache``): the stand-ins for
  another stage's layers return as many values from the first forward on.

Zamba's and Zamba2's Linears no rule splits, kept whole, are tests/test_generic_layer_linears.py's.

What they still cannot take is skipped with plait's one-line reason, before any process starts. One launch of 2
ranks runs every pair (PAIRS: tp2-sp and pp2-1f1b of each, zero1-dp2 of two).
"""

from __future__ import annotations

import pytest

from plait.testing.conformance_modes import LOSS_RTOL
from plait_transformers import derivation, plait_tiny_config, sp_region
from plait_transformers.common import Refusal
from plait_transformers.derivation import derive

from releases import needs_model_type

pytest_plugins = ["plait.testing.pytest_plugin"]

ARCHITECTURES = ("bert-generation", "biogpt", "ctrl", "git", "openai-gpt", "xglm", "trocr", "codegen", "gptj", "xlnet",
                 "falcon_h1", "bamba", "recurrent_gemma", "zamba", "zamba2", "modernbert-decoder", "phi4_multimodal",
                 "llama4", "qwen3_5", "qwen3_5_moe", "gemma3", "fuyu", "got_ocr2", "moss_transcribe_diarize", "rwkv")
MODES = ("zero1-dp2", "pp2-1f1b", "tp2-sp")
SKIPPED = {
    ("xlnet", "pp2-1f1b"): "takes ['output_g'] besides the hidden states",
}
# zero1-dp2 uses no plan of the generic adapter's (every rank holds the whole model; ZeRO-1 shards the optimizer
# state by flat buffers, whatever the architecture): each tiny config's running at all is shown by its tp2-sp and
# pp2-1f1b here, and the architecture sweep (docs/architectures.md's zero1-dp2 column) runs zero1-dp2 on every
# architecture. It stays here on two: Gemma3, whose vision tower gets no gradient (ZeRO-1's flat buffers give it
# zeros, one process None), and Zamba, whose shared transformer block is called by several layers.
ZERO1_KEPT = ("gemma3", "zamba")
PAIRS = [(a, m) for a in ARCHITECTURES for m in MODES if m != "zero1-dp2" or a in ZERO1_KEPT]


@pytest.fixture(scope="module")
def results(plait_conformance):
    return plait_conformance(pairs=[(f"transformers:{a}", m) for a, m in PAIRS])


@pytest.mark.parametrize("arch, mode", PAIRS)
def test_more_architectures(results, arch, mode):
    from plait.testing.pytest_plugin import format_results

    result = results[f"transformers:{arch}", mode]
    if (arch, mode) in SKIPPED:
        assert result.status == "skipped" and SKIPPED[arch, mode] in result.note, format_results([result])
        return
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1


def test_decoder_layers_are_found_in_the_module_tree_where_transformers_declares_none():
    """GIT holds two lists of 4 layers of one class: its text layers, nearest the top, not its vision tower's.
    BERT's embeddings block is staged by its parts, so later stages can run it on their stand-in."""
    assert derive(plait_tiny_config("git")).leaves == ["git.encoder.layer.*"]
    pipeline = derive(plait_tiny_config("bert-generation")).pipeline
    assert pipeline.layers == "bert.encoder.layer" and pipeline.last == ("lm_head",)
    assert pipeline.first[0] == "bert.embeddings.word_embeddings"
    assert "bert.embeddings.position_embeddings" in pipeline.neutralize
    assert derive(plait_tiny_config("openai-gpt")).sp.end == "transformer.h.3"  # no final norm: the last layer


def test_a_conv1d_fused_qkv_split_by_width_is_split_by_heads():
    """OpenAI GPT's attention computes its scores itself from a Conv1D c_attn split by width (``x.split(self.split_size,
    dim=2)``) into heads of ``self.n_head``: split by heads, its widths per rank (its tp2-sp and consolidation cells
    pass split, in this file's world and docs/architectures.md), where it was kept whole."""
    rule = next(r for r in derive(plait_tiny_config("openai-gpt")).tp.rules if r.pattern == "transformer.h.*.attn")
    assert (type(rule).__name__, rule.qkv, rule.o) == ("Attention", "c_attn", "c_proj")
    assert rule.local_attrs == {"split_size": "q_width", "n_head": "q_heads"}


def test_an_mlp_on_the_decoder_layer_is_split_whole_or_flattened_to_tokens(monkeypatch):
    """OPT flattens the hidden states to [tokens, hidden] before fc1: the sequence gather and reduce-scatter work
    on the tokens (the second-to-last dimension), so it splits as XGLM's. Its final norm is registered before its
    layers and run after them: the sequence-parallel region ends at it. Were it missed (the region ending at the
    last layer), SP would be refused, not run with the norm's gradient one vocab shard's."""
    for arch, layers in (("xglm", "model.layers"), ("opt", "model.decoder.layers")):
        rules = {type(r).__name__ + ":" + r.pattern for r in derive(plait_tiny_config(arch)).tp.rules}
        assert {f"Column:{layers}.*.fc1", f"Row:{layers}.*.fc2"} <= rules
    assert derive(plait_tiny_config("opt")).sp.end == "model.decoder.final_layer_norm"
    monkeypatch.setattr(sp_region, "_final_norm", lambda model, layers: None)
    monkeypatch.setattr(derivation, "_CACHE", {})
    refusal = derive(plait_tiny_config("opt")).sp
    assert isinstance(refusal, Refusal)
    assert str(refusal).startswith("opt: model.decoder.final_layer_norm: a norm beside the layers that the "
                                   "sequence-parallel region does not end at")


def test_stand_ins_return_as_many_values_as_the_model_unpacks():
    """Bamba unpacks ``hidden_states, attn_weights`` from each layer and only collects the weights: a later stage's
    stand-ins return two values before the stage's own layers have run. RWKV hands its ``state`` to the next
    layer, but only with ``use_cache`` is it anything but None (checked on every forward). GLM-MoE-DSA hands its
    second value (topk_indices) to the next layer as ``prev_topk_indices``: stages carry it beside the hidden
    states (tests/test_pipeline.py's hy_v4 check cuts before a layer that reads it)."""
    from plait.pipeline.stages import LayerForm

    import torch

    bamba, rwkv = derive(plait_tiny_config("bamba")).pipeline, derive(plait_tiny_config("rwkv")).pipeline
    assert (bamba.layer_outputs, bamba.none_outputs) == (2, ())
    assert (rwkv.layer_outputs, rwkv.none_outputs) == (3, (1,))  # its state, threaded, None without use_cache
    assert derive(plait_tiny_config("llama")).pipeline.layer_outputs == 0
    assert LayerForm(2).wrap("h") == ("h", None) and LayerForm(0).wrap("h") == "h"
    form = LayerForm(3, (1,))
    form.record(torch.nn.Identity(), (), ("h", None, None))
    with pytest.raises(RuntimeError, match=r"returned something other than None in entries \[1\]"):
        form.record(torch.nn.Identity(), (), ("h", torch.zeros(1), None))  # a state would be lost between stages
    glm = derive(plait_tiny_config("glm_moe_dsa")).pipeline
    assert (glm.layer_outputs, glm.none_outputs, glm.carried) == (2, (), ((1, "prev_topk_indices"),))


def test_an_absent_input_embedding_answers_a_one_token_probe_only():
    """Gemma-4-unified finds its image/video/audio placeholders on every forward, on later stages (no input ids)
    by comparing ``inputs_embeds`` with the embedding of one token id: the absent embedding answers NaN, equal to
    no hidden state. Any other call is still the clear error. (Its pp2-1f1b then matches one process in float64:
    loss 2e-16, grad 0.004 of tolerance; in fp32 step 1 is within tolerance, later steps are Adam-amplified
    fp32 noise, as its zero1-dp2.)"""
    import torch

    from plait.pipeline.stages import Absent

    probe = Absent("model.embed_tokens", 0, embedding_dim=8)(torch.full((), 5, dtype=torch.long))
    assert probe.shape == (8,) and probe.isnan().all()
    assert not (torch.zeros(2, 3, 8) == probe).all(-1).any()
    for absent, ids in ((Absent("model.embed_tokens", 0, embedding_dim=8), torch.zeros(2, 3, dtype=torch.long)),
                        (Absent("model.norm", 1), torch.full((), 5, dtype=torch.long))):
        with pytest.raises(RuntimeError, match="belongs to pipeline stage"):
            absent(ids)


def test_layers_that_read_the_token_ids_run_every_stage_on_them():
    plan = derive(plait_tiny_config("deepseek_v4")).pipeline  # hash routing by token id in every layer
    assert plan.token_ids and plan.every_stage == ()  # the ids alone: the embedding stays the first stage's


@pytest.mark.parametrize("arch, prefix", [("gemma4_text", "model."), ("gemma4", "model.language_model.")])
def test_per_layer_embeddings_are_held_by_every_stage(arch, prefix):
    """Gemma's per-layer inputs: a second embedding of the token ids plus a projection of the input embedding,
    handed to every layer beside the hidden states. Every stage computes them from the token ids, so it holds
    them, the input embedding the projection reads included; the rest of the first modules stay stage 0's."""
    plan = derive(plait_tiny_config(arch)).pipeline
    assert plan.token_ids
    assert plan.every_stage == tuple(f"{prefix}{name}" for name in (
        "embed_tokens", "embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"))
    assert plan.neutralize == ()


def test_a_module_with_parameters_feeding_the_layers_beside_the_hidden_states():
    """CPM-Ant's relative position bias, handed to the encoder beside the hidden states: every pipeline stage holds
    it and computes it from the batch; on sequence shards its gradient would cover one shard only: refused."""
    derived = derive(plait_tiny_config("cpmant"))
    assert derived.pipeline.every_stage == ("cpmant.position_bias",) and derived.pipeline.token_ids
    assert derived.pipeline.layer_outputs == 2  # layer_outputs = layer(...); hidden_states, attn_weights = layer_outputs
    refusal = derived.sp
    assert isinstance(refusal, Refusal) and "\n" not in str(refusal)
    assert str(refusal).startswith("cpmant: cpmant.position_bias: has parameters and its output (position_bias) goes "
                                   "to the layers beside the hidden states")
    assert str(refusal).endswith("disable sequence parallelism")


@needs_model_type("dory", "5.24")
def test_layers_run_several_times_per_forward_are_refused_for_pipeline_stages():
    """Dory runs its middle layers n_recurrent_loops times (a loop over a slice of the layer list inside another
    loop): stages that ran each layer once would be a different model (the sweep measured pp2 4e3x over tolerance
    before this refusal). xLSTM's loop over its blocks inside a chunk loop runs under torch.no_grad() only
    (inference prefill), so its stages stand."""
    refusal = derive(plait_tiny_config("dory")).pipeline
    assert isinstance(refusal, Refusal)
    assert str(refusal) == ("dory: model.layers: DoryModel.forward runs `self.layers[recurrent_start:recurrent_end]` "
                            "inside another loop, so some layers run several times per forward; pipeline stages run "
                            "each layer once: use pp=1")
    assert derive(plait_tiny_config("xlstm")).pipeline.layers == "backbone.blocks"


def test_a_module_handed_to_a_function_is_refused_for_pipeline_stages():
    """BLT hands its hash embeddings to ``compute_hash_embeddings`` instead of calling them: stages are cut in the
    order the forward calls modules, so it had no place (the sweep's pp2 failed at the first forward)."""
    refusal = derive(plait_tiny_config("blt")).pipeline
    assert isinstance(refusal, Refusal)
    assert str(refusal) == ("blt: model.encoder_hash_tok_embedding: BltModel.forward hands it to a function instead of "
                            "calling it, so plait cannot tell which pipeline stage runs it: use pp=1")
