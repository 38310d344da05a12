"""float8 training (torchao's float8 linear, emulated on CPU) under plait: one process against bf16, tp=2 with SP and
ZeRO-1 dp=2, pp=2 and cp=2 against one process (one world of 2 ranks, tests/workers/float8_parity.py), and every
refusal.

Tolerances are the measured differences (torch 2.13 CPU, torchao 0.18.0; the same at 1 and 2 threads) with a margin
of about 2x for float8's rounding and 3-4x for fp32 noise (a few units in the last place), so a float8 path that went
wrong (a transposed operand, a wrong scale, the high-precision matmul instead) fails while float8's own rounding
passes. Emulation rounds the operands to float8 exactly as the GPU kernels do and multiplies in fp32.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig

import plait
from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.lora.config import lora_config
from plait.parallel import float8
from plait.parallel.float8 import check_float8_device, float8_modules
from plait.run.train_args import TrainArgs, add_arguments, from_namespace
from plait.run.trainer import Trainer
from plait.testing import launch
from tiny_models import tiny_config, tiny_model
from workers.float8_parity import LAYOUTS, LINEARS, RECIPES, float8_llama, make_batches, train, worst_grad

WORKER = str(Path(__file__).parent / "workers" / "float8_parity.py")


def emulated(recipe: str, **kwargs) -> ParallelConfig:
    return ParallelConfig(float8=recipe, float8_emulate=True, **kwargs)


# --------------------------------------------------------------------------------------------------
# One process: float8 against bf16 (plait at tp=1 converts with torchao's convert_to_float8_training)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_runs() -> dict:
    """3 AdamW steps (lr 1e-3) of the tiny Llama in bf16 parameters: without float8, and with each recipe."""
    base, batches = float8_llama(torch.bfloat16), make_batches()
    runs = {"bf16": train(copy.deepcopy(base), batches), "fp32": train(float8_llama(), batches)}
    for recipe in RECIPES:
        pmodel = plait.parallelize(copy.deepcopy(base), emulated(recipe))
        runs[recipe] = train(pmodel.module, batches) | {"layers": float8_modules(pmodel.module),
                                                         "types": {type(m).__name__ for m in pmodel.module.modules()}}
    return runs


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_process_float8_is_bf16_within_float8_rounding(bf16_runs, recipe):
    run, bf16 = bf16_runs[recipe], bf16_runs["bf16"]
    # applied, and only to the decoder layers' linears (not the LM head or embeddings)
    assert len(run["layers"]) == LINEARS and all(".layers." in name for name in run["layers"]), run["layers"]
    assert "Float8Linear" in run["types"]
    loss = max(abs(a - b) / b for a, b in zip(run["losses"], bf16["losses"]))
    grads = max(worst_grad(g, r) for g, r in zip(run["grads"], bf16["grads"]))
    first = worst_grad(run["grads"][0], bf16["grads"][0])  # same weights: float8's rounding alone
    # Measured: loss 3.0e-4 (tensorwise) / 2.9e-4 (rowwise) relative; gradients (worst parameter, relative norm of
    # the difference) 0.12 / 0.094 at the first step, 0.145 / 0.115 over the 3 steps (Adam's sign-like first
    # updates carry the rounding into the weights); bf16 itself against fp32: loss 5.1e-5, gradients 0.012 at the
    # first step, 0.020 over the 3.
    assert loss < 6e-4 and grads < 0.25, (loss, grads)
    # Not silently high precision: float8 moves the gradients by far more than bf16's own rounding does.
    assert first > 3 * worst_grad(bf16["grads"][0], bf16_runs["fp32"]["grads"][0]), first


def test_float8_recomputes_alike_and_runs_under_autocast():
    """Activation checkpointing recomputes the same float8 casts (bitwise equal gradients); under bf16 autocast the
    float8 matmuls take bf16 inputs, as Float8Linear does, and land near the autocast run without float8."""
    base, ids = float8_llama(), make_batches()[0]
    results = {}
    for name, config in {"plain": emulated("rowwise"), "recompute": emulated("rowwise", gradient_checkpointing=True),
                         "autocast": emulated("rowwise", bf16_autocast=True),
                         "autocast-bf16": ParallelConfig(bf16_autocast=True)}.items():
        pmodel = plait.parallelize(copy.deepcopy(base), config)
        loss = pmodel.train_step(ids, ids)
        results[name] = (loss, {n: p.grad for n, p in pmodel.module.named_parameters()})
    assert torch.equal(results["plain"][0], results["recompute"][0])
    assert all(torch.equal(g, results["recompute"][1][n]) for n, g in results["plain"][1].items())
    loss, grads = results["autocast"]
    reference_loss, reference = results["autocast-bf16"]
    # measured: loss 1.5e-4 relative, gradients 0.105 (worst parameter)
    assert 0 < abs(loss - reference_loss).item() / reference_loss.item() < 3e-4
    assert worst_grad(grads, reference) < 0.2


# --------------------------------------------------------------------------------------------------
# tp=2 with SP, ZeRO-1 dp=2, pp=2 and cp=2 against one process (one world of 2 ranks)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("float8") / "out.json"
    launch([WORKER, str(out)], 2, timeout=240)
    return json.loads(out.read_text())


def test_tp2_sp_rowwise_follows_one_process(parity):
    """Rowwise scales are powers of 2: a value's float8 rounding does not depend on its scale, so per-shard scales
    give what one process gives, to fp32 noise."""
    for rank, r in enumerate(parity["tp2-sp-rowwise"]):
        assert len(r["float8_layers"]) == LINEARS and r["names_unchanged"], (rank, r)
        assert "float8=axiswise (emulated)" in r["repr"], r["repr"]  # plait's row-parallel layer, in float8
        # measured: loss 1.2e-7, gradients 3.5e-7, parameters after 3 steps 2.0e-8 (relative)
        assert r["loss_f8"] < 5e-7 and r["grad_f8"] < 1e-6 and r["param_f8"] < 8e-8, (rank, r)
        # against fp32 without float8: measured loss 5.2e-4, gradients 0.13; float8 is on (not 0)
        assert 1e-5 < r["loss_hp"] < 1e-3 and 0.01 < r["grad_hp"] < 0.25, (rank, r)
        # the float8 tp=2 checkpoint, loaded at dp=2 without float8: the same weights (layout-free)
        assert r["checkpoint_equal"] and r["checkpoint_float8_layers"] == 0, (rank, r)


def test_tp2_sp_tensorwise_within_float8_rounding(parity):
    """Tensorwise scales are per shard at tp=2 (the whole tensor's in one process) and not powers of 2, so the two
    round differently: as far apart as float8 is from high precision. With power-of-2 scales (the same recipe,
    round_scales_to_power_of_2) they agree to fp32 noise, which puts the whole difference on the scales."""
    for rank, r in enumerate(parity["tp2-sp-tensorwise"]):
        assert len(r["float8_layers"]) == LINEARS and r["names_unchanged"], (rank, r)
        # measured: loss 2.3e-4, gradients 0.156, parameters 0.025 against one process in float8; loss 2.9e-4,
        # gradients 0.15 against fp32 without float8
        assert r["loss_f8"] < 5e-4 and r["grad_f8"] < 0.3 and r["param_f8"] < 0.05, (rank, r)
        assert 1e-5 < r["loss_hp"] < 6e-4 and 0.01 < r["grad_hp"] < 0.3, (rank, r)
    for rank, r in enumerate(parity["tp2-sp-tensorwise-pow2"]):
        # measured: loss 1.2e-7, gradients 1.2e-6, parameters 7.0e-8
        assert r["loss_f8"] < 5e-7 and r["grad_f8"] < 3e-6 and r["param_f8"] < 2e-7, (rank, r)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero1_pp_and_cp_follow_one_process(parity, layout):
    """plait's optimizer step, rowwise: ZeRO-1 dp=2 (each rank scales its half of the batch), pp=2 (each stage its
    layer, 2 microbatches), cp=2 (each rank its half of every sequence)."""
    for rank, r in enumerate(parity[f"{layout}-rowwise"]):
        held = LINEARS // 2 if layout == "pp2" else LINEARS
        assert len(r["float8_layers"]) == held and r["names_unchanged"], (rank, r)
        # measured, each layout: loss 1.2e-7; gradient norm 7.2e-8 (zero1, cp2) / 7.0e-8 (pp2); parameters after 3
        # steps 2.3e-8 / 2.3e-8 / 3.1e-8; against fp32 without float8: loss 5.2e-4
        assert r["loss_f8"] < 5e-7 and r["norm_f8"] < 2e-7 and r["param_f8"] < 1e-7, (rank, r)
        assert 1e-5 < r["loss_hp"] < 1e-3, (rank, r)


# --------------------------------------------------------------------------------------------------
# Refusals: each one line, before any process group or weight
# --------------------------------------------------------------------------------------------------


def test_a_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setattr(float8, "installed", lambda: False)
    message = r"^float8=rowwise needs torchao, not installed here; pip install 'plait\[float8\]'$"
    with pytest.raises(ConfigError, match=message):
        TrainArgs(float8="rowwise").validate()
    with pytest.raises(ConfigError, match=message):
        plan_layout(build_meta_model(tiny_config("llama")), ParallelConfig(float8="rowwise"))


def test_float8_is_marked_experimental_until_it_is_faster():
    """--float8 measured 1.13x bf16's tokens/s on an H200 for a 1B model but 0.49x for a 3B one with activation
    checkpointing (README, GPU section): its help and README (flag table, float8 section) say it is experimental,
    with those numbers and what ends it, so nobody turns it on for speed."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = next(a.help for a in parser._actions if "--float8" in a.option_strings)
    assert text.startswith("EXPERIMENTAL (measured on an H200: 1.13x bf16's tokens/s for a 1B model, 0.49x for a 3B "
                           "one with --gradient_checkpointing; experimental until that case is understood)"), text
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "`--float8 {tensorwise,rowwise}` (experimental: 1.13x bf16 on an H200 for a 1B model, 0.49x for a 3B one " \
           "with activation checkpointing)" in readme
    section = readme[readme.index("## float8 matmuls"):].split("\n## ", 1)[0]
    assert "**Experimental.**" in section and "1.13x" in section and "0.49x" in section


def test_flags_and_their_refusals():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = from_namespace(parser.parse_args(["--float8", "rowwise", "--float8_emulate", "--block_size", "32"]))
    args.validate()
    config = args.parallel_config()
    assert (config.float8, config.float8_emulate) == ("rowwise", True)
    assert "float8=rowwise (emulated)" in config.describe()
    assert TrainArgs().parallel_config().float8 is None  # off by default
    with pytest.raises(ConfigError, match=r"^--float8='mxfp8' is unknown; choose one of tensorwise, rowwise$"):
        TrainArgs(float8="mxfp8").validate()
    with pytest.raises(ConfigError, match=r"^float8='mxfp8' is unknown"):
        ParallelConfig(float8="mxfp8")
    with pytest.raises(ConfigError, match=r"^--float8_emulate emulates float8 matmuls, but --float8 is not given"):
        TrainArgs(float8_emulate=True).validate()
    with pytest.raises(ConfigError, match=r"^float8_emulate=True emulates float8 matmuls, but float8 is off"):
        ParallelConfig(float8_emulate=True)
    with pytest.raises(ConfigError, match=r"--block_size=40 / cp=2 is not a multiple of 16, .* multiple of 32$"):
        TrainArgs(float8="tensorwise", block_size=40, context_parallel_size=2, nproc_per_node=2).validate()


def test_real_float8_needs_a_float8_gpu(tmp_path):
    with pytest.raises(ConfigError, match=r"^float8=rowwise: float8 matmuls \(torch._scaled_mm\) run on CUDA GPUs of "
                                          r"compute capability 8.9 or more .* this run is on cpu: add float8_emulate=True"):
        check_float8_device(ParallelConfig(float8="rowwise"), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"this run is on cpu"):  # a model holding CPU weights, before any group
        plait.parallelize(float8_llama(), ParallelConfig(float8="tensorwise"))
    with pytest.raises(ConfigError, match=r"this run is on cpu"):  # plait train: before any data is read
        Trainer(TrainArgs(float8="rowwise", device="cpu", output_dir=str(tmp_path)))
    check_float8_device(emulated("rowwise"), "cpu")  # emulation runs anywhere
    check_float8_device(ParallelConfig(float8="rowwise"), "meta")  # the device is checked when weights arrive


@pytest.mark.parametrize("case", ["lora", "moe", "conv1d", "tp2-narrow"])
def test_unsupported_combinations_are_refused(case):
    config, lora, world = emulated("rowwise"), None, None
    if case == "lora":
        model, lora = build_meta_model(tiny_config("llama")), lora_config(4, 8.0)
        expected = r"^float8=rowwise with LoRA is not supported .*; train LoRA without float8$"
    elif case == "moe":
        model = build_meta_model(MixtralConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               num_local_experts=4, num_experts_per_tok=2))
        expected = (r"^float8=rowwise: mixtral is a mixture-of-experts model \(model.layers.0.mlp.experts: routed "
                    r"experts computed with grouped matmuls, .*\); train it without float8$")
    elif case == "conv1d":
        model = build_meta_model(tiny_config("gpt2"))
        expected = r"^float8=rowwise: transformer.h.0.attn.c_attn is a transformers Conv1D \(GPT-2's transposed linear\)"
    else:  # head_dim 8 with 2 kv heads: k_proj is 16 wide, 8 per rank at tp=2
        model, config, world = build_meta_model(tiny_config("llama")), emulated("rowwise", tp=2), 2
        expected = (r"^float8=rowwise: model.layers.0.self_attn.k_proj's weight is \[8, 32\] \[out, in\] on tp rank 0 "
                    r"of tp=2; float8 matmuls \(torch._scaled_mm\) need both dims to be multiples of 16")
    with pytest.raises(ConfigError, match=expected):
        plan_layout(model, config, world, lora=lora)


def test_a_training_microbatch_of_tokens_not_a_multiple_of_16_is_refused():
    pmodel = plait.parallelize(tiny_model("llama"), emulated("tensorwise"))
    ids = torch.zeros(1, 15, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"^float8=tensorwise: a training microbatch holds 15 tokens per rank"):
        pmodel.train_step(ids, ids)
    with torch.no_grad():  # forward only: no weight-gradient matmul, any length
        pmodel(ids)
