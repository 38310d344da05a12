"""Dropout under tensor and sequence parallelism (tp/rng.py): replicated activations get one mask on every
tp rank, sharded ones (local heads, sequence shards) a different mask per rank; recomputation redraws the
same masks; resume stays bit-exact; and tp=2 + SP trains like tp=1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch
from tiny_models import tiny_config

WORKER = str(Path(__file__).parent / "workers" / "dropout_worker.py")
TRAINERS = str(Path(__file__).parent / "workers" / "trainers.py")
# GPT2 calls dropout, per layer: attention probabilities (local heads), then the residual dropouts after the
# attention and MLP output projections; the embedding dropout comes first.
EMBEDDING, PER_LAYER = 1, 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropout")
    launch([WORKER, str(out)], 2, timeout=240)
    return json.loads((out / "dropout.json").read_text())


def calls_by_kind(case: dict, key: str) -> dict[str, list]:
    values = case[key][EMBEDDING:]
    return {"embedding": case[key][:EMBEDDING], "attention": values[0::PER_LAYER],
            "residual": values[1::PER_LAYER] + values[2::PER_LAYER]}


def test_every_dropout_drops_something(results):
    for case in ("tp2-nosp", "tp2-sp"):
        assert len(results[case]["dropped"]) == EMBEDDING + 2 * PER_LAYER
        assert all(n > 0 for n in results[case]["dropped"])


def test_without_sp_replicated_masks_agree_and_head_masks_differ(results):
    kinds = calls_by_kind(results["tp2-nosp"], "masks_equal")
    assert kinds["embedding"] == [True] and kinds["residual"] == [True] * 4
    assert kinds["attention"] == [False, False]  # local heads: each rank its own mask
    assert results["tp2-nosp"]["layer_outputs_equal"] == [True, True]  # replicated hidden states stay bitwise equal


def test_under_sp_sequence_shard_masks_differ(results):
    kinds = calls_by_kind(results["tp2-sp"], "masks_equal")
    assert kinds["embedding"] == [True]  # before the SP region: replicated
    assert kinds["attention"] == [False, False] and kinds["residual"] == [False] * 4


def test_recomputation_redraws_the_same_masks(results):
    assert results["recompute"]["recompute_grad_diff"] == 0.0


def test_resume_with_dropout_is_bit_exact_and_tp_sp_trains_like_tp1(tmp_path):
    """Three Trainer runs in one 2-rank world (workers/trainers.py): tp=2 + SP straight through 24 steps (saving
    at 12), the same resumed from step 12, and tp=1 at dp=2 on the same global batch of 4."""
    config = tmp_path / "gpt2.json"
    config.write_text(tiny_config("gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1).to_json_string())
    base = dict(model_config=str(config), block_size=16, per_device_train_batch_size=4, learning_rate=3e-3,
                max_steps=24, device="cpu")
    cases = {"straight": {**base, "tensor_parallel_size": 2, "save_steps": 12},
             "resumed": {**base, "tensor_parallel_size": 2,
                         "resume_from_checkpoint": str(tmp_path / "straight" / "checkpoint-12")},
             "tp1": {**base, "per_device_train_batch_size": 2}}
    for name, case in cases.items():
        case["output_dir"] = str(tmp_path / name)
    (tmp_path / "flags.json").write_text(json.dumps(cases))
    launch([TRAINERS, str(tmp_path / "out.json"), str(tmp_path / "flags.json")], 2, timeout=300)
    runs = {name: [r for r in ranks[0]["history"] if "loss" in r]
            for name, ranks in json.loads((tmp_path / "out.json").read_text()).items()}
    straight, resumed, one = runs["straight"], runs["resumed"], runs["tp1"]
    assert [r["step"] for r in resumed] == list(range(13, 25))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[12:24]]
    mean = lambda rows: sum(r["loss"] for r in rows[-8:]) / 8  # noqa: E731
    first = straight[0]["loss"]
    print(f"loss step 1 {first:.4f}; mean of the last 8 steps: tp=2+SP {mean(straight):.4f}, tp=1 {mean(one):.4f}")
    # the curves fall alike: the last 8 steps' means differ by far less than the distance fallen
    assert abs(mean(straight) - mean(one)) < 0.1 * (first - mean(one))
