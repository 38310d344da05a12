"""MoE routing metrics (plait.run.moe_metrics): a step's tokens per expert are the model's own router's, counted once per
training forward (not in evaluation, not again when activation checkpointing recomputes a layer), the same summed
over dp, cp, tp with SP and pp ranks; ``plait train`` logs them for an MoE model and not for a dense one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.run.log_line import progress_text
from plait.run.metrics import read_metrics
from plait.run.moe_metrics import RoutingMetrics
from plait.run.train_args import TrainArgs
from plait.run.trainer import train
from plait.testing import launch
from plait.testing.conformance_modes import load_subject
from tiny_models import tiny_config
from workers.moe_metrics_worker import CASES, build, hand_count, reference_aux

WORKER = str(Path(__file__).parent / "workers" / "moe_metrics_worker.py")


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_counts_are_the_routers_own_once_per_training_forward(arch):
    """Two steps of 2 microbatches, each layer recomputed in backward, an evaluation after each step: every step's
    counts are a hand count of its own batch, and its aux loss transformers' mean over its two forwards."""
    reference, pmodel = build(arch, dict(num_microbatches=2, gradient_checkpointing=True))
    routing = RoutingMetrics.install(pmodel)
    assert routing.names == [f"model.layers.{i}.mlp.experts" for i in range(reference.config.num_hidden_layers)]
    for seed in (1, 2):
        ids = torch.randint(0, reference.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(seed))
        pmodel.train_step(ids, labels=ids)
        pmodel.eval_loss(ids, labels=ids)
        step = routing.take()
        assert [t.tolist() for t in step.tokens] == hand_count(reference, ids)
        assert step.aux_loss == pytest.approx(reference_aux(reference, ids, 2), rel=1e-6)
        record = step.record()
        assert record["moe_load"] == [round(x, 4) for x in step.loads()]
        assert record["moe_load_max_over_mean"] == max(step.loads()) > 1


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_metrics")
    launch([WORKER, str(out)], 2, timeout=300)
    return json.loads((out / "moe_metrics.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_counts_over_a_world_of_two_are_one_process_counts(world, case):
    record = world[case]
    assert record["tokens"] == record["expected"]
    assert len(record["names"]) == 4  # rank 0 logs every pipeline stage's layers
    if record["expected_aux"] is None:  # pp: transformers' aux loss is refused there
        assert record["aux_loss"] is None
    else:
        assert record["aux_loss"] == pytest.approx(record["expected_aux"], rel=1e-6)


def run(tmp_path: Path, config, name: str) -> tuple[list[dict], dict]:
    path = tmp_path / f"{name}.json"
    path.write_text(config.to_json_string())
    out = tmp_path / name
    train(TrainArgs(model_config=str(path), output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                    block_size=16, learning_rate=1e-3))
    return read_metrics(out), read_metrics(out, "load")[0]


def test_metrics_jsonl_has_routing_for_an_moe_run_only(tmp_path):
    config = load_subject("transformers:mixtral").config
    config.output_router_logits = True
    records, load = run(tmp_path, config, "moe")
    assert load["moe_layers"] == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    for record in records:
        assert len(record["moe_load"]) == 4 and 1 < record["moe_load_max_over_mean"] <= config.num_local_experts
        assert record["moe_load_max_over_mean"] == pytest.approx(max(record["moe_load"]), abs=1e-4)
        assert 0 < record["aux_loss"] < record["loss"]
    assert f"moe max/mean {records[-1]['moe_load_max_over_mean']:.2f}" in progress_text(records[-1])
    dense, load = run(tmp_path, tiny_config("llama"), "dense")
    assert not any(key.startswith("moe") or key == "aux_loss" for record in [*dense, load] for key in record)
    assert "moe" not in progress_text(dense[-1])
