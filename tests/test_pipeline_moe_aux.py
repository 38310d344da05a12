"""The MoE router's load-balancing loss under pipeline parallelism (mixtral, qwen3_moe): the router logits travel
down the pipeline and the last stage computes transformers' aux loss over every layer (plait.pipeline.router),
so loss and every gradient, routers of every stage included, are one process's: 1f1b, interleaved and
zero-bubble with 2 virtual stages per rank, gpipe, a padding mask with recomputation, and with dp, tp + SP and
cp beside pp.
A model whose aux loss is computed by another call is refused before any process group exists."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.testing import launch
from plait.testing.conformance_modes import load_subject

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from pipeline_moe_aux import CASES  # noqa: E402

WORKER = str(Path(__file__).parent / "workers" / "pipeline_moe_aux.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pipeline_moe_aux")
    merged: dict[str, dict] = {}
    for tag, world in (("w2", 2), ("w4", 4)):
        launch([WORKER, str(out), tag], world, timeout=400)
        merged.update(json.loads((out / f"{tag}.json").read_text()))
    return merged


@pytest.mark.parametrize("case", [case for cases in CASES.values() for case in cases])
def test_aux_loss_parity_under_pipeline(results, case):
    record = results[case]
    assert record["failures"] == [] and not record["crashed"], record["failures"]
    assert record["loss_rel"] <= 1e-5 and record["eval_rel"] <= 1e-5 and record["grad_tol"] <= 1
    assert record["aux_share"] > 0.05  # the aux loss is a real part of what was compared
    assert record["checked"] == sorted(record["expected"])  # every stage's parameters, routers included


def test_an_aux_loss_computed_by_another_call_is_refused():
    config = copy.deepcopy(load_subject("transformers:doge").config)
    config.output_router_logits = True
    with pytest.raises(ConfigError) as err:
        plan_layout(build_meta_model(config), ParallelConfig(pp=2, num_microbatches=2), world_size=2)
    assert str(err.value).startswith("output_router_logits=True under pipeline parallelism: DogeForCausalLM.forward "
                                     "does not compute its load-balancing loss as `load_balancing_loss_func(")
    assert str(err.value).endswith("set output_router_logits=False or pp=1")
