"""Attention rules of the generic adapter for blocks transformers' tp plans shard in ways plait's other rules do not
read, each with one-process parity through the conformance kit (3 AdamW steps, float64) and each refusing on the
meta model what it cannot place:

- Dots3-Note: latent attention whose layers differ only by a sparse-attention indexer (the other layers have none),
  with a per-head sigmoid gate (``g_proj(hidden_states).view(..., -1, 1)``) and a norm on the shared rotary key
  that transformers' plan keeps replicated with its gradient all-reduced: one LatentAttention per layer, the gate
  split with the heads, the norm whole with its gradient summed over tp;
- HY-V4: the same latent attention with one sink logit per head (``s_aux=self.sinks``, sharded by transformers'
  plan) and a gate of v_head_dim values per head (``view(..., -1, self.gate_projection_size)``), split with the
  heads; its decoder layers pass hyper-connection streams [batch, sequence, streams, hidden], which sequence
  parallelism would split by streams: tp=2 without SP runs, SP is refused;
- DiffLlama: differential attention pairing q head h with h + H/2 (values chunked in two along the kv heads, the
  output in two along the heads): each rank keeps the same run of heads from each half, so its pairs are whole
  (PairedHeadsAttention), and its lambda vectors ([head_dim], reduced to one scalar read by every head) stay whole
  with their gradients summed over tp;
- Zaya, JetMoE: softmax attention whose projections no rule splits (Zaya's q/k convolved along the sequence, JetMoE's
  mixture of attention heads) kept whole and run on the whole sequence under SP (WholeSequence), as attention with
  its own kernel is; JetMoE's MoE block, kept whole the same way, adds a bias of its own (replicated specs);
- Inkling2: its ``block_states``, carried from layer to layer beside the hidden states, refuse SP before launch;
- Bloom, MPT: attention computing its scores itself, with an ALiBi bias per head built by the model for all heads
  (Bloom's ``alibi`` [batch * heads, 1, S], MPT's ``position_bias`` [heads, 1, S]) and one fused q/k/v projection
  (Bloom's ``query_key_value`` head by head, (heads, 3, head_dim); MPT's ``Wqkv`` q | k | v, chunked in three):
  split by heads, each rank handed its own heads' slopes of the bias (``Attention.head_inputs``), with and without
  SP;
- GPT-BigCode, Falcon: multi-query attention with one fused projection, q heads | one k | one v head (GPT-BigCode's
  ``c_attn`` split by its widths, Falcon's ``query_key_value`` viewed as heads + 2): the q heads split, the kv head
  replicated, and only the fused weight's k and v rows summed over tp and counted once in the norm
  (``ModuleShard.shared_ranges``); tests/test_undeclared_architectures.py runs their tp2-sp in fp32, here the
  consolidation round trip in float64.

One launch of 2 ranks runs every pair, in float64, where a mis-split layer stays off by 1e-4 or more.
"""

from __future__ import annotations

import pytest
from packaging.version import Version
import torch

from plait.base.meta import build_meta_model
from plait.testing.conformance_modes import LOSS_RTOL
from plait.parallel.grad_sync import norm_params
from plait.tp.sharding import Part
from plait.tp.styles import Attention, LatentAttention, PairedHeadsAttention, ReplicatedGradSum
from plait_transformers import plait_tiny_config
from plait_transformers.common import Refusal
from plait_transformers.derivation import derive, tp_plan

from releases import TRANSFORMERS

pytest_plugins = ["plait.testing.pytest_plugin"]

ARCHITECTURES = ("dots3_note_text", "diffllama", "zaya", "jetmoe", "bloom", "mpt")
MODES = ("tp2-sp", "consolidate-tp2-sp")
WITHOUT_SP = (("hy_v4", "tp2"),)  # architectures whose TP plan runs, but not under sequence parallelism
ALSO_WITHOUT_SP = (("bloom", "tp2"), ("mpt", "tp2"))  # the ALiBi slices without SP too
MULTI_QUERY = (("gpt_bigcode", "consolidate-tp2-sp"), ("falcon", "consolidate-tp2-sp"))


@pytest.fixture(scope="module")
def results(plait_conformance):
    return plait_conformance(*(f"transformers:{a}" for a in ARCHITECTURES), modes=list(MODES), dtype="float64",
                             pairs=[(f"transformers:{a}", mode) for a, mode in (*WITHOUT_SP, *ALSO_WITHOUT_SP,
                                                                                 *MULTI_QUERY)])


@pytest.mark.parametrize(("arch", "mode"), [*((a, m) for a in ARCHITECTURES for m in MODES), *WITHOUT_SP,
                                            *ALSO_WITHOUT_SP, *MULTI_QUERY])
def test_attention_rule_parity(results, arch, mode):
    from plait.testing.pytest_plugin import format_results

    result = results[f"transformers:{arch}", mode]
    assert result.status == "pass", format_results([result])
    assert result.loss_rel is not None and result.loss_rel <= LOSS_RTOL
    assert result.grad_tol is not None and result.grad_tol <= 1


@pytest.mark.parametrize("arch", ["gpt_bigcode", "falcon"])
def test_multi_query_shares_the_kv_rows_and_counts_them_once(arch):
    """The derived rule splits the q heads and replicates the one kv head; at tp=2 each rank's fused weight is
    [its q rows | k | v], the k and v rows summed over both ranks; in the norm rank 0 counts all its rows, rank 1
    its q rows only, so every row of the full weight is counted exactly once."""
    config = plait_tiny_config(arch)
    rule = next(r for r in derive(config).tp.rules if isinstance(r, Attention))
    assert (rule.qkv, rule.num_kv_heads) == ({"gpt_bigcode": "c_attn", "falcon": "query_key_value"}[arch], 1)
    heads, hd = rule.num_heads, rule.head_dim
    model = build_meta_model(config)
    name = f"{rule.pattern.replace('*', '0')}.{rule.qkv}"
    shards = [{s.name: s for s in rule.shards(rule.pattern.replace("*", "0"),
                                               model.get_submodule(rule.pattern.replace("*", "0")), 2, r)}[name]
              for r in range(2)]
    assert [s.weight.ranges for s in shards] == [
        ((0, heads * hd // 2), (heads * hd, (heads + 1) * hd), ((heads + 1) * hd, (heads + 2) * hd)),
        ((heads * hd // 2, heads * hd), (heads * hd, (heads + 1) * hd), ((heads + 1) * hd, (heads + 2) * hd))]
    assert [(s.grad_sum_block, s.shared_ranges) for s in shards] == [(2, (1, 2))] * 2
    specs = [{f"{name}.weight": s.weight} for s in shards]
    param = torch.nn.Parameter(torch.empty(shards[0].weight.local_shape, device="meta"))
    counted = [norm_params([(f"{name}.weight", param)], specs, r) for r in range(2)]
    assert counted[0] == ([param], {})
    assert counted[1] == ([param], {f"{name}.weight": Part(0, ((0, heads * hd // 2),))})


def latent_rules(arch: str) -> dict[str, LatentAttention]:
    plan = derive(plait_tiny_config(arch)).tp
    return {r.pattern: r for r in plan.rules if isinstance(r, LatentAttention)}


def test_latent_layers_differing_by_an_indexer_get_one_rule_each():
    """Dots3's and HY-V4's indexer sits in every other layer only: one rule per layer, each replicating its own."""
    for arch in ("dots3_note_text", "hy_v4"):
        rules = latent_rules(arch)
        assert sorted(rules) == [f"model.layers.{i}.self_attn" for i in range(4)]
        indexed = [p for p, r in rules.items() if any(m.startswith("indexer.") for m in r.replicated)]
        assert indexed == ["model.layers.0.self_attn", "model.layers.2.self_attn"]


def test_dots3_gate_and_rotary_key_norm():
    rule = latent_rules("dots3_note_text")["model.layers.1.self_attn"]
    assert rule.head_columns == ("g_proj",) and "k_rope_only_layernorm" in rule.replicated and not rule.head_params


def test_hy_v4_sinks_and_gate_split_with_the_heads():
    config = plait_tiny_config("hy_v4")
    rule = latent_rules("hy_v4")["model.layers.1.self_attn"]
    assert (rule.head_columns, rule.head_params) == (("gate_proj",), ("sinks",))
    block = build_meta_model(config).get_submodule("model.layers.1.self_attn")
    shards = {s.name: s for s in rule.shards("model.layers.1.self_attn", block, 2, 1)}
    gate = shards["model.layers.1.self_attn.gate_proj"]
    assert gate.weight.ranges == ((2 * 8, 4 * 8),)  # heads 2-3 of v_head_dim 8 values each
    assert shards["model.layers.1.self_attn"].params["sinks"].ranges == ((2, 4),)


def test_hyper_connection_streams_refuse_sequence_parallelism():
    sp = derive(plait_tiny_config("hy_v4")).sp
    assert isinstance(sp, Refusal) and "hyper-connection streams" in str(sp) and "disable sequence parallelism" in str(sp)


def test_latent_attention_parameter_that_is_no_sink_is_refused():
    """A parameter of the block itself that is not one sink logit per head passed as s_aux: refused, not replicated."""
    config = plait_tiny_config("hy_v4")
    model = build_meta_model(config)
    for layer in model.model.layers:
        layer.self_attn.sinks = type(layer.self_attn.sinks)(layer.self_attn.sinks.new_empty(8))
    with pytest.raises(Refusal, match=r"self_attn\.sinks: a parameter of latent attention itself \(shape \(8,\)"):
        tp_plan(model, config, "model.layers", [])


def test_a_gate_not_read_per_head_is_not_split_with_the_heads(monkeypatch):
    """A Linear of heads outputs that the forward does not apply per head is no head gate: refused as a stray."""
    from plait_transformers import latent

    monkeypatch.setattr(latent, "_head_gate", lambda block, child, per_head: False)
    config = plait_tiny_config("dots3_note_text")
    with pytest.raises(Refusal, match=r"self_attn\.g_proj: a module with parameters inside latent attention"):
        tp_plan(build_meta_model(config), config, "model.layers", [])


def test_diffllama_pairs_heads_across_the_halves():
    """Tiny DiffLlama: 4 q heads (pairs 0|2, 1|3), 2 kv heads (one per half, replicated over the 2 ranks)."""
    config = plait_tiny_config("diffllama")
    rule = next(r for r in derive(config).tp.rules if r.pattern == "model.layers.*.self_attn")
    assert isinstance(rule, PairedHeadsAttention)
    assert rule.shared_params == ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
    block = build_meta_model(config).get_submodule("model.layers.0.self_attn")
    shards = {s.name: s for s in rule.shards("a", block, 2, 1)}
    assert shards["a.q_proj"].weight.ranges == ((8, 16), (24, 32))  # heads 1 and 3 of head_dim 8
    assert shards["a.k_proj"].weight.ranges == ((0, 8), (8, 16)) and shards["a.k_proj"].grad_sum_block == 2
    assert shards["a.o_proj"].weight.ranges == ((16, 32),)  # pair 1: [out1 | out2] of head_dim 8 each
    assert shards["a.q_proj"].local_attrs == {"num_key_value_groups": 1}
    shared = shards["a"]
    assert isinstance(shared.style, ReplicatedGradSum) and shared.grad_sum_block == 2
    assert set(shared.params) == set(rule.shared_params)


def test_paired_heads_with_a_parameter_not_reduced_to_a_scalar_are_refused():
    config = plait_tiny_config("diffllama")
    model = build_meta_model(config)
    for layer in model.model.layers:
        layer.self_attn.lambda_k1 = type(layer.self_attn.lambda_k1)(layer.self_attn.lambda_k1.new_empty(4))
    with pytest.raises(Refusal, match=r"self_attn\.lambda_k1: a parameter inside attention pairing head h"):
        tp_plan(model, config, "model.layers", [])


def test_softmax_attention_no_rule_splits_runs_whole():
    rules = {r.pattern: r for r in derive(plait_tiny_config("jetmoe")).tp.rules}
    assert type(rules["model.layers.*.self_attention"]).__name__ == "WholeSequence"
    moe = rules["model.layers.*.mlp"]
    block = build_meta_model(plait_tiny_config("jetmoe")).get_submodule("model.layers.0.mlp")
    shard = moe.shards("model.layers.0.mlp", block, 2, 1)[0]
    assert shard.bias.full_shape == tuple(block.bias.shape) and shard.bias.dim is None  # whole on every rank


def test_a_side_input_carried_from_layer_to_layer_refuses_sequence_parallelism():
    sp = derive(plait_tiny_config("inkling2_text")).sp
    if TRANSFORMERS < Version("5.24"):  # the Inkling 2 before 5.24 had two attention classes at one path, refused first
        assert isinstance(sp, Refusal) and "attention blocks of different classes" in str(sp), sp
        return
    assert isinstance(sp, Refusal) and "carries block_states from layer to layer" in str(sp)


@pytest.mark.parametrize(("arch", "style", "qkv_ranges", "bias"), [
    ("bloom", "HeadInterleavedAttention", ((48, 96),), "alibi"),  # heads 2-3: [q k v] of head_dim 8 each
    ("mpt", "Attention", ((16, 32), (48, 64), (80, 96)), "position_bias"),  # heads 2-3 of q, of k, of v
])
def test_alibi_attention_splits_heads_and_hands_each_rank_its_slopes(arch, style, qkv_ranges, bias):
    """Attention computing its scores itself with a per-head ALiBi bias: split by heads (no longer kept whole), the
    bias argument sliced to the rank's heads."""
    import torch

    from plait.tp.apply import _slice_head_inputs

    config = plait_tiny_config(arch)
    rule = next(r for r in derive(config).tp.rules if type(r).__name__ == style)
    assert rule.head_inputs == (bias,) and not any(type(r).__name__ == "WholeSequence" for r in derive(config).tp.rules)
    name = rule.pattern.replace("*", "0")
    block = build_meta_model(config).get_submodule(name)
    first = rule.shards(name, block, 2, 1)[0]
    assert first.weight.ranges == qkv_ranges and first.head_inputs == {bias: (4, 2, 4)}
    hook = _slice_head_inputs(block, first.head_inputs)
    full = torch.arange(3 * 4 * 5.0).view(3 * 4, 1, 5)  # [batch * heads, 1, S]: batch 3, 4 heads
    _, kwargs = hook(block, (), {bias: full})
    assert torch.equal(kwargs[bias], full.view(3, 4, 1, 5)[:, 2:4].reshape(6, 1, 5))
    args, _ = hook(block, (torch.zeros(1), *((None,) if arch == "bloom" else ()), full[:4]), {})  # by position
    assert torch.equal(args[-1], full[2:4])
