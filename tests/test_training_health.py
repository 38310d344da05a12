"""Training health: a diverging run stops before it can save garbage, metrics stay strict JSON, lr 0 trains
nothing, and `--skip_nonfinite_steps` skips (and counts) bad steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plait.checkpoint import consolidate
from plait.checkpoint.format import list_checkpoints
from plait.cli import main
from plait.testing import launch
from tiny_models import tiny_config

TRAINERS = str(Path(__file__).parent / "workers" / "trainers.py")
# A NaN written into rank 0's gradients after step 2's backward (plait/base/faults.py), as a diverging run makes them. Made
# by construction: where an extreme learning rate takes the weights depends on the CPU's kernels (with lr 1e4 an
# AVX-512 Xeon saturated the tiny Llama at step 1 instead: grad_norm 0, no NaN, no guard fired).
NAN_AT = {"PLAIT_FAULT_INJECT": "0:2:nan"}


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return str(path)


def train_flags(model_config: str, out, *extra: str) -> list[str]:
    return ["train", "--model_config", model_config, "--output_dir", str(out), "--max_steps", "6",
            "--block_size", "16", "--per_device_train_batch_size", "4", *extra]


def strict_records(out) -> list[dict]:
    """metrics.jsonl parsed as strict JSON: a bare NaN / Infinity token fails the parse."""
    def refuse(token: str):
        raise ValueError(f"non-strict JSON token {token}")
    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_diverging_run_stops_before_saving_garbage(model_config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("PLAIT_FAULT_INJECT", NAN_AT["PLAIT_FAULT_INJECT"])
    with pytest.raises(SystemExit) as exit_info:
        main(train_flags(model_config, out, "--max_grad_norm", "0", "--save_steps", "1"))
    assert exit_info.value.code == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("plait: error: step 2: non-finite grad_norm (loss=")
    assert "the step was not applied and no checkpoint was saved" in err and "lower --learning_rate (now 0.001)" in err
    assert "clip with --max_grad_norm 1.0" in err
    assert f"(the newest checkpoint is {out / 'checkpoint-1'}, from before it)" in err
    assert err.endswith("or skip such steps with --skip_nonfinite_steps")
    records = strict_records(out)
    bad = records[-1]
    assert bad["step"] == 2 and bad["grad_norm"] is None and bad["nonfinite"] == ["grad_norm"] and bad["skipped"]
    saved = list_checkpoints(out)
    assert [p.name for p in saved] == ["checkpoint-1"]  # step 2 saved nothing
    for checkpoint in saved:
        weights = load_file(consolidate(checkpoint, tmp_path / f"hf-{checkpoint.name}") / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values())


def test_skip_nonfinite_steps_counts_then_stops(model_config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("PLAIT_FAULT_INJECT", "0:2-4:nan")  # steps 2, 3 and 4: two skipped, the third stops
    with pytest.raises(SystemExit) as exit_info:
        main(train_flags(model_config, out, "--skip_nonfinite_steps", "2"))
    assert exit_info.value.code == 3
    steps = [r for r in strict_records(out) if "step" in r and "event" not in r]
    assert [(r["step"], r.get("skipped", False), r.get("skipped_steps", 0)) for r in steps] == [
        (1, False, 0), (2, True, 1), (3, True, 2), (4, True, 3)]
    err = capsys.readouterr().err
    assert "step 4: non-finite" in err
    assert "(the run has no checkpoint)" in err  # --save_steps 0: none before the end
    assert "or allow more skipped steps than --skip_nonfinite_steps 2 (this was non-finite step 3)" in err
    lines = [line for line in err.splitlines() if line.startswith("step 3/6 | ")]  # stderr is no terminal here
    assert len(lines) == 1 and " | grad_norm nan | not applied (non-finite) | skipped 2 | " in lines[0], err


def test_learning_rate_zero_trains_nothing(model_config, tmp_path):
    from plait import ParallelConfig
    from plait.checkpoint.materialize import load_parallel_model
    from plait.run.model_config import load_config_file

    out = tmp_path / "out"
    main(train_flags(model_config, out, "--learning_rate", "0", "--max_steps", "3", "--save_steps", "3"))
    records = [r for r in strict_records(out) if "loss" in r]
    assert len(records) == 3 and all(r["lr"] == 0.0 and math.isfinite(r["loss"]) for r in records)
    trained = load_file(consolidate(out / "checkpoint-3", tmp_path / "hf") / "model.safetensors")
    init = load_parallel_model(load_config_file(Path(model_config)), ParallelConfig(), seed=0).module.state_dict()
    assert all(torch.equal(trained[name], init[name]) for name in trained)


@pytest.fixture(scope="module")
def diverged(model_config, tmp_path_factory) -> dict:
    """A run whose rank 1 alone gets a NaN gradient at step 2, at tp=2, cp=2 and ZeRO-3, in one world of 2 ranks
    (tests/workers/trainers.py)."""
    root = tmp_path_factory.mktemp("diverge")
    base = dict(model_config=model_config, max_steps=6, block_size=16, per_device_train_batch_size=4, device="cpu")
    cases = {f"{name}2": {**base, name: 2, "output_dir": str(root / name)}
             for name in ("tensor_parallel_size", "context_parallel_size")}
    # ZeRO-3 at dp=2 (the same global batch): the norm of FSDP2's sharded gradients is the same on both ranks
    cases["zero_stage3"] = {**base, "zero_stage": 3, "per_device_train_batch_size": 2, "output_dir": str(root / "z3")}
    (root / "flags.json").write_text(json.dumps(cases))
    launch([TRAINERS, str(root / "out.json"), str(root / "flags.json")], 2, timeout=240,
           env={"PLAIT_FAULT_INJECT": "1:2:nan"})
    return {case: (ranks, Path(cases[case]["output_dir"])) for case, ranks in
            json.loads((root / "out.json").read_text()).items()}


@pytest.mark.parametrize("case", ["tensor_parallel_size2", "context_parallel_size2", "zero_stage3"])
def test_diverging_run_stops_every_rank(diverged, case):
    """At tp=2, cp=2 and ZeRO-3 dp=2 (each rank a part of every token, of every sequence, or of every parameter)
    both ranks see the same loss and norm, so rank 0 stops at the step whose NaN only rank 1's gradients held."""
    ranks, out = diverged[case]
    assert [r.get("diverged", "")[:27] for r in ranks] == ["step 2: non-finite grad_nor"] * 2, ranks
    assert strict_records(out)[-1]["step"] == 2