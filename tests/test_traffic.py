"""Issue 30: the step time's non-matmul work, counted by operation on the meta device (``costs.traffic``), and
sdpa's math path where the device's fused kernel takes no attention dropout (torch's CPU kernel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from plait.base.config import ParallelConfig
from plait.base.meta import build_meta_model
from plait.costs.activations import FIRST, LAST, UnitTrace, trace_activations
from plait.costs.device import PRESETS
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.memory import Precision
from plait.costs.traffic import BACKWARD, PLAIN, TrafficCounter, is_square
from plait.layout_plan import plan_layout
from plait.plugin.registry import default_registry

SEQ = 32


def gpt2(dropout: float = 0.1) -> GPT2Config:
    return GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=dropout,
                      embd_pdrop=dropout, attn_pdrop=dropout)


def llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=SEQ)


def trace(config, fused_dropout: bool = True):
    registry = default_registry()
    model = build_meta_model(config)
    return model, trace_activations(model, SEQ, registry, registry.resolve(model.config), fused_dropout)


def real_forward(config) -> tuple[dict[str, UnitTrace], list[torch.Tensor]]:
    """One CPU forward (train mode, one sequence) of ``config``'s model: each unit's traffic as the counter sees
    the real run, and every tensor autograd saves."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    names = [f"transformer.h.{i}" if config.model_type == "gpt2" else f"model.layers.{i}"
             for i in range(config.num_hidden_layers)]
    units = {FIRST: UnitTrace(), LAST: UnitTrace(), **{n: UnitTrace() for n in names}}
    where = {"unit": FIRST}
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(lambda *_, n=name: where.update(unit=n))
    final = "transformer.ln_f" if config.model_type == "gpt2" else "model.norm"
    model.get_submodule(final).register_forward_pre_hook(lambda *_: where.update(unit=LAST))
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: list[torch.Tensor] = []
    ids = torch.randint(0, config.vocab_size, (1, SEQ))
    with TrafficCounter(units, where, SEQ, config.hidden_size, params), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(input_ids=ids, labels=ids)
    return units, saved


def test_meta_trace_counts_the_cpu_forwards_operations():
    """The meta trace's bytes by operation and unit are those a real CPU forward of GPT-2 moves (dropout on: sdpa
    runs its math path on both), and it counts the operations a CPU runs slowly (tanh GELU, dropout's random
    numbers, softmax) under their own names."""
    units, _ = real_forward(gpt2())
    _, traced = trace(gpt2(), fused_dropout=False)
    assert traced.first.traffic.bytes == units[FIRST].traffic.bytes
    assert traced.last.traffic.bytes == units[LAST].traffic.bytes
    for layer, name in zip(traced.layers, ("transformer.h.0", "transformer.h.1")):
        assert layer.traffic.bytes == units[name].traffic.bytes
    ops = {op for op, _ in traced.layers[0].traffic.bytes}
    assert {"tanh", "bernoulli_", "_safe_softmax", "native_layer_norm", PLAIN} <= ops


def test_sdpa_keeps_the_probabilities_where_its_kernel_takes_no_dropout():
    """On a CPU (no fused dropout) sdpa with attention dropout runs the math path: the trace keeps the s x s
    tensors a real CPU forward saves (bytes equal), and its traffic; on a GPU (fused) neither; without attention
    dropout the CPU's fused kernel runs and keeps none either."""
    _, saved = real_forward(gpt2())
    squares = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in saved}.values()
                  if is_square(t, SEQ) and t.is_floating_point())
    _, cpu = trace(gpt2(), fused_dropout=False)
    assert cpu.squares and cpu.math_attention
    assert sum(s.nbytes for u in cpu.layers for s in u.saved if s.square) == squares > 0
    _, gpu = trace(gpt2(), fused_dropout=True)
    assert not gpu.squares and not any(s.square for u in gpu.layers for s in u.saved)
    _, no_dropout = trace(gpt2(dropout=0.0), fused_dropout=False)
    assert not no_dropout.squares and not no_dropout.math_attention


def _layer_traffic(model, trace_, config: ParallelConfig, world: int) -> float:
    plan = plan_layout(model, config, world, default_registry())
    estimate = estimate_layout(model, plan, Batch(2, SEQ), Precision(), trace_)
    return sum(estimate.act_bytes_moved[0].values())


def test_traffic_per_rank_follows_tp_sp_cp_and_recomputation():
    """Per rank: tp=2 with SP halves everything in the decoder layers (hidden-sized tensors are sequence shards),
    without SP the hidden-sized ones stay whole; cp=2 halves all; recomputation runs each layer's forward again;
    the backward moves ``BACKWARD`` times the forward's bytes."""
    model, traced = trace(llama())
    assert not traced.squares  # sdpa: the meta device's math path counts s x s scores no fused kernel moves
    layers = sum(b for u in traced.layers for (_, kind), b in u.traffic.bytes.items() if kind != "square")
    hidden = sum(b for u in traced.layers for (_, kind), b in u.traffic.bytes.items() if kind == "hidden")
    ends = sum(sum(u.traffic.bytes.values()) for u in (traced.first, traced.last))
    base = _layer_traffic(model, traced, ParallelConfig(), 1)
    assert base == pytest.approx(2 * (layers + ends) * (1 + BACKWARD))
    recompute = _layer_traffic(model, traced, ParallelConfig(gradient_checkpointing=True), 1)
    assert recompute - base == pytest.approx(2 * layers)
    assert _layer_traffic(model, traced, ParallelConfig(cp=2), 2) == pytest.approx(base / 2)
    sp = _layer_traffic(model, traced, ParallelConfig(tp=2, disable_embedding_parallelization=True), 2)
    nosp = _layer_traffic(model, traced, ParallelConfig(tp=2, sp=False, disable_embedding_parallelization=True), 2)
    ends_sp = 2 * (1 + BACKWARD) * sum(b for (_, kind), b in traced.last.traffic.bytes.items() if kind == "hidden")
    assert sp == pytest.approx(2 * (1 + BACKWARD) * (layers / 2 + ends) - ends_sp / 2)
    assert nosp - sp == pytest.approx(2 * (1 + BACKWARD) * hidden / 2 + ends_sp / 2)


def test_an_operation_the_device_runs_slowly_slows_only_the_models_that_run_it():
    """A device whose tanh runs at a tenth of its bandwidth plans GPT-2 (tanh GELU) slower and the Llama (SiLU)
    as before."""
    cpu = PRESETS["cpu"]
    slow_tanh = dataclasses.replace(cpu, op_bandwidth=(("tanh", cpu.memory_bandwidth / 10),))

    def step(config, device) -> float:
        model, traced = trace(config, fused_dropout=False)
        plan = plan_layout(model, ParallelConfig(), 1, default_registry())
        return estimate_layout(model, plan, Batch(2, SEQ), Precision(), traced).step_time(device)

    assert step(gpt2(), slow_tanh) > step(gpt2(), cpu)
    assert step(llama(), slow_tanh) == step(llama(), cpu)


@pytest.mark.parametrize("config", [gpt2(), llama()], ids=["gpt2", "llama"])
def test_a_fused_kernel_keeps_nothing_that_grows_with_the_square_of_the_sequence(config):
    """Under a fused kernel every tensor a layer keeps is per token: twice the tokens, twice the bytes, also where
    sdpa's math path on meta folds the probabilities to [heads, s, s] (GPT-2's dropped-out ones: on an H200 the
    planner's peak was 1.42-1.52 of the allocator's until they were recognised) and where the sequence is as long as
    the hidden size (SEQ = 32 = hidden: [1, s, h] hidden states are no attention scores)."""
    registry = default_registry()
    model = build_meta_model(config)
    saved = {seq: [sum(s.nbytes for s in unit.saved) for unit in
                   trace_activations(model, seq, registry, registry.resolve(model.config)).layers]
             for seq in (SEQ // 2, SEQ)}
    assert saved[SEQ] == [2 * b for b in saved[SEQ // 2]]
