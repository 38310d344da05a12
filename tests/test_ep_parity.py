"""Expert parallelism against one process (tests/workers/ep_parity.py): six MoE families at ep=2 (DBRX's own experts
module among them) with the router's aux loss on where they have one, ZeRO-1, ZeRO-2/3 (FSDP2 units of the experts'
own: qwen3_moe at ep=2, and in a dp=4 world where they shard over the 2 ranks holding the same experts; DBRX's
experts module; Llama 4's expert-major experts with tp x SP; with cp and with pp), cp x ep, recomputation with
microbatches, ep x tp with SP, ep x pp (the aux loss carried across stages), ep=2 in a dp=4 world, ep=4, experts
kept whole over tp (with and without SP, with and without ep); every rank's gradient shards compared, every expert
parameter compared by the rank holding it; the global gradient norm without ZeRO; the capacity factor's dropped
pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch

WORKER = str(Path(__file__).parent / "workers" / "ep_parity.py")
CASES = {2: ["mixtral|ep2", "qwen3_moe|ep2", "deepseek_v3|ep2", "gpt_oss|ep2", "olmoe|ep2", "dbrx|ep2",
             "llama4_text|ep2",
             "qwen3_moe|ep2-zero1", "qwen3_moe|ep2-zero3", "dbrx|ep2-zero2", "qwen3_moe|cp2-ep2-zero3",
             "mixtral|cp2-ep2", "mixtral|ep2-recompute-microbatches2", "mixtral|ep2-capacity-no-drop",
             "qwen3_moe|tp2-whole-experts", "gpt_oss|tp2-nosp-whole-experts"],
         4: ["mixtral|ep2-tp2", "qwen3_moe|ep2-dp4-zero1", "mixtral|ep4", "llama4_text|ep4", "qwen3_moe|ep2-pp2",
             "qwen3_moe|ep2-dp4-zero3", "llama4_text|ep2-tp2-zero2", "qwen3_moe|ep2-pp2-zero3",
             "qwen3_moe|ep2-tp2-whole-experts", "mixtral|ep2-tp2-nosp-whole-experts"]}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"ep{request.param}")
    launch([WORKER, str(out), str(request.param)], request.param, timeout=500)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


def test_expert_parallel_parity(ranks):
    for case in CASES[len(ranks)]:
        records = [rank[case] for rank in ranks]
        for rank, record in enumerate(records):
            assert record["failures"] == [] and not record["crashed"], (case, rank, record["failures"])
            assert record["loss_rel"] <= 1e-5 and record["grad_tol"] <= 1, (case, rank)
        checked = set().union(*(r["checked"] for r in records))
        assert checked == set(records[0]["expected"]), (case, set(records[0]["expected"]) - checked)
        if not case.startswith(("deepseek_v3", "dbrx", "llama4_text")):
            assert records[0]["aux_share"] > 0.05, case  # the aux loss is a real part of what was compared
        held = {r["experts_held"] for r in records}
        assert len(held) == 1 and held.pop() > 0, case  # every rank holds the same number of expert weights


def test_expert_parallel_grad_norm_and_capacity(ranks):
    if len(ranks) != 2:
        pytest.skip("world of 2 only")
    for rank in ranks:
        assert rank["norm"]["norm"] == pytest.approx(rank["norm"]["expected"], rel=1e-5)
        capacity = rank["capacity"]
        assert capacity["dropped"] == capacity["expected"] > 0 and capacity["finite"]
        assert capacity["reported"] == capacity["expected_total"]  # the step's metrics, summed over ranks
