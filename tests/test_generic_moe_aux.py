"""The MoE router's load-balancing loss through the generic adapter (mixtral, qwen3_moe): with
``output_router_logits`` on, plait trains on transformers' loss (cross-entropy + coef x aux) averaged over a
step's forwards, under tp with and without SP (router logits gathered from sequence shards), dp, ZeRO-1,
recomputation, microbatches and cp (both strategies: the logits gathered over the cp group); an attention mask
beside SP or cp is refused before any collective. Pipeline parallelism: tests/test_pipeline_moe_aux.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch

WORKER = str(Path(__file__).parent / "workers" / "moe_aux_worker.py")
CASES = [f"{arch}|{name}" for arch in ("mixtral", "qwen3_moe")
         for name in ("tp2-sp", "tp2", "dp2", "zero1-dp2", "tp2-sp-recompute", "tp2-sp-microbatches2", "cp2",
                      "cp2-ring-microbatches2")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_aux")
    launch([WORKER, str(out)], 2, timeout=400)
    return json.loads((out / "moe_aux.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_aux_loss_parity(results, case):
    """Every rank's record; the router and expert gradients the aux loss reaches compared on some rank (under
    ZeRO-1 each on its owner)."""
    for rank, record in enumerate(results[case]):
        assert record["failures"] == [] and not record["crashed"], f"rank {rank}: {record['failures']}"
        assert record["loss_rel"] <= 1e-5 and record["grad_tol"] <= 1, f"rank {rank}: {record}"
        assert record["aux_share"] > 0.05  # the aux loss is a real part of what was compared
    checked = set().union(*(record["checked"] for record in results[case]))
    routed = {n for n in results[case][0]["expected"] if "gate" in n or "experts" in n}
    assert checked >= routed, f"never compared: {sorted(routed - checked)}"


def test_aux_loss_with_a_mask_under_sp_is_refused(results):
    assert results["refused|mask-sp"][0].startswith("an attention_mask with output_router_logits under sequence "
                                                    "parallelism")
    assert results["refused|mask-cp"][0].startswith("an attention_mask with output_router_logits under context "
                                                    "parallelism")
