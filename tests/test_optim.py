"""ZeRO-1, global-norm clipping, gradient accumulation, activation checkpointing and bf16 (plait.optim).

One launch per layout (tests/workers/optim_parity.py) trains every variant against the same single-process
reference; the tests below assert on its JSON. Adding a layout is one line in LAYOUTS, e.g. (1, 2) for
pp=2 x dp=2 once pipeline parallelism is in ``parallelize``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.testing import launch

WORKER = Path(__file__).parent / "workers" / "optim_parity.py"
LAYOUTS = {"dp2": (1, 1), "tp2_dp2": (2, 1)}  # (tp, pp); dp = 2 in each
TOL = 1e-5


@pytest.fixture(scope="module", params=list(LAYOUTS))
def results(request, tmp_path_factory) -> dict:
    tp, pp = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "results.json"
    launch([str(WORKER), str(out), str(tp), str(pp)], tp * pp * 2, timeout=240)
    return json.loads(out.read_text())


def _parity(r: dict) -> None:
    assert r["loss_rel"] <= TOL, f"losses {r['losses']} vs reference {r['ref_losses']}: max rel {r['loss_rel']:.2e}"
    assert r["param_diff"] <= TOL, f"parameters differ from the reference by up to {r['param_diff']:.2e}"


def test_zero1_matches_one_process(results):
    _parity(results["zero1"])
    assert results["zero1"]["owned_fraction"] <= 0.5 + 0.05, results["zero1"]


def test_zero1_is_bit_exact_against_plain_dp(results):
    r = results["zero1_vs_dp"]
    assert r["losses"] == r["dp_losses"], r
    assert r["max_local_param_diff"] == 0.0, f"ZeRO-1 vs AdamW after finish_grad_sync: {r['max_local_param_diff']:.2e}"


@pytest.mark.parametrize("variant", ["clip_zero1", "clip_dp"])
def test_clipping_uses_the_global_norm(results, variant):
    r = results[variant]
    assert min(r["ref_norms"]) > r["max_norm"], f"reference norms {r['ref_norms']} never clip at {r['max_norm']}"
    assert r["norm_rel"] <= TOL, f"norms {r['norms']} vs clip_grad_norm_ {r['ref_norms']}"
    _parity(r)


def test_accumulation_matches_double_batch_and_defers_dp_reduction(results):
    r = results["accumulation"]
    _parity(r)
    assert r["micro_reduce_ops"] == 0, f"{r['micro_reduce_ops']} dp reductions during micro-steps"
    assert r["first_micro_collectives"] == r["last_micro_collectives"], (
        f"micro-step 1 issued {r['first_micro_collectives']} collectives, the last {r['last_micro_collectives']}")
    assert r["step_reduce_ops"] == r["dp"], f"{r['step_reduce_ops']} reduce ops in the step (one bucket per owner)"
    if r["tp"] == 1:  # with tp=1 every collective would be a dp one
        assert r["first_micro_collectives"] == 0, r


def test_activation_checkpointing_parity_and_recompute(results):
    r = results["checkpointing"]
    _parity(r)
    assert (r["mlp_calls_without"], r["mlp_calls_per_micro_step"]) == (1, 2), r


@pytest.mark.parametrize("variant", ["bf16_master", "bf16_autocast", "bf16_reduce_bf16", "bf16_reduce_fp32"])
def test_bf16_close_to_fp32(results, variant):
    r = results[variant]
    assert r["loss_rel"] <= 2e-2, f"{variant}: max rel loss difference {r['loss_rel']:.3e}"
    assert r["stepped_dtypes"] == r["state_dtypes"] == [str(torch.float32)], r
    bf16_params = variant != "bf16_autocast"
    assert r["param_dtypes"] == [str(torch.bfloat16 if bf16_params else torch.float32)], r
    assert r["local_optimizer"] == ("MasterWeightOptimizer" if bf16_params else "AdamW"), r


def test_reduce_dtype_sets_bytes_on_the_wire(results):
    r = results["reduce_dtype"]
    assert (r["bf16_bytes"], r["fp32_bytes"]) == (2 * r["numel"], 4 * r["numel"]), r
