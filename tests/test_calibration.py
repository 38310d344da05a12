"""Issue 30: ``plait plan --calibrate`` measures the efficiency from a short training run, caches it, and
``--recalibrate`` replaces it."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from transformers import LlamaConfig

from plait.cli import main
from plait.config import ParallelConfig
from plait.costs import calibration
from plait.costs.activations import trace_activations
from plait.costs.calibration import SEQUENCES, TOKENS, EfficiencyRun, cache_path, calibrate, measure_efficiency
from plait.costs.device import PRESETS
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.memory import Precision
from plait.costs.traffic import TIMED_OPS
from plait.layout_plan import plan_layout
from plait.meta import build_meta_model
from plait.registry import default_registry

# A peak far above what one CPU thread reaches: the run's efficiency is then well under 1, never clamped at peak
FAST = dataclasses.replace(PRESETS["cpu"], flops_fp32=1e12, flops_bf16=1e12)
MACHINE = {"name": "calibrated", "memory_bytes": 2**34, "flops_bf16": 5e10, "flops_fp32": 5e10,
           "memory_bandwidth": 1e10, "intra_bandwidth": 1e9, "inter_bandwidth": 1e9, "per_node": 2,
           "latency": 1e-4, "op_speed": [["all_gather", 0.4], ["reduce_scatter", 0.2]], "fused_adamw": False}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty calibration cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return cache_path()


def planned_step(run: EfficiencyRun, microbatches: int = 1) -> float:
    """The planner's step time for the calibration batch as ``microbatches`` micro-batches (accumulation) on
    ``FAST`` at ``run``'s efficiency and overhead, built here independently."""
    meta = build_meta_model(calibration.run_config())
    registry = default_registry()
    plan = plan_layout(meta, ParallelConfig(), 1, registry)
    trace = trace_activations(meta, TOKENS, registry, plan.adapter)
    batch = Batch(SEQUENCES // microbatches, TOKENS, microbatches)
    estimate = estimate_layout(meta, plan, batch, Precision(), trace)
    return estimate.step_time(dataclasses.replace(FAST, efficiency=run.efficiency,
                                                  microbatch_overhead=run.microbatch_overhead))


class AddedTime:
    """The calibration's clock (this thread's CPU time) plus seconds a test adds without spending them: added work
    far beyond the machine's drift (one step's time varies up to 1.5x between minutes on this VM: 0.15 s of spun
    work once came out as 0.14 s) makes the comparisons safe, and costs the suite no time."""

    def __init__(self) -> None:
        self.added = 0.0

    def thread_time(self) -> float:
        return time.thread_time() + self.added


def test_solved_in_a_world_of_two_the_planner_gives_both_steps():
    """bench/plan_check.py solves the step model from the calibration run timed at dp=2, where the step also
    holds the gradient all-reduce: at the solved values the planner's dp=2 estimates give both measured steps, and
    the all-reduce is not taken for matmul time (the efficiency is higher than if the rest were ignored)."""
    one, several = calibration.run_estimates(calibration.run_config(), world=2)
    assert any(op.group == "dp" for op in one.comm[0])
    efficiency, overhead = calibration.solve_step_model(FAST, one, several, 0.4, 0.5)
    solved = dataclasses.replace(FAST, efficiency=efficiency, microbatch_overhead=overhead)
    assert one.step_time(solved) == pytest.approx(0.4, rel=1e-9)
    assert several.step_time(solved) == pytest.approx(0.5, rel=1e-9)
    at_peak = one.flops[0] / FAST.flops_fp32
    assert efficiency > at_peak / (0.4 - max(one.layers.values()) * overhead)


def test_efficiency_and_overhead_make_the_planner_give_both_measured_steps(monkeypatch):
    """The planner's model at the measured efficiency and per-micro-batch overhead reproduces both runs' steps
    (one micro-batch, and the same batch as several); a slower step (the same FLOPs, 2 s more work) gives a
    lower efficiency, and work added per micro-batch a larger overhead (the added work is added to the clock)."""
    run = measure_efficiency(FAST)
    assert 0 < run.efficiency < 1 and run.microbatch_overhead > 0
    assert planned_step(run) == pytest.approx(run.step_seconds, rel=1e-9)
    assert planned_step(run, SEQUENCES) == pytest.approx(run.split_step_seconds, rel=1e-9)
    assert run.mfu == pytest.approx(run.flops / run.step_seconds / FAST.flops_fp32)
    train_step = calibration._train_step
    clock = AddedTime()
    monkeypatch.setattr(calibration, "time", clock)

    def slow_step(pmodel, step, microbatches):
        train_step(pmodel, step, microbatches)
        clock.added += 2.0

    monkeypatch.setattr(calibration, "_train_step", slow_step)
    slow = measure_efficiency(FAST)
    assert slow.step_seconds > run.step_seconds + 1.0  # the real step drifts by tenths of a second at most
    assert slow.flops == run.flops and slow.efficiency < run.efficiency
    assert planned_step(slow) == pytest.approx(slow.step_seconds, rel=1e-9)

    def per_microbatch(pmodel, step, microbatches):
        train_step(pmodel, step, microbatches)
        clock.added += 0.5 * len(microbatches)  # 125 ms per layer of the run's 4 for each extra micro-batch

    monkeypatch.setattr(calibration, "_train_step", per_microbatch)
    costly = measure_efficiency(FAST)
    assert costly.microbatch_overhead > run.microbatch_overhead + 0.06  # the real overhead: 5 +- 6 ms
    assert planned_step(costly, SEQUENCES) == pytest.approx(costly.split_step_seconds, rel=1e-9)


def test_run_leaves_the_random_state_and_threads_as_they_were():
    threads = torch.get_num_threads()
    state = torch.get_rng_state()
    calibration._timed_runs(calibration.run_config(), (1, 2))
    assert torch.equal(torch.get_rng_state(), state) and torch.get_num_threads() == threads


def fake_runs(monkeypatch, efficiencies: list[float]) -> list[int]:
    """Measurements replaced: the machine by ``MACHINE``, each run by the next of ``efficiencies``; returns
    the list the runs are counted in."""
    calls: list[int] = []

    def run(device):
        assert device.efficiency == 1.0 and device.flops_fp32 == MACHINE["flops_fp32"]
        calls.append(1)
        efficiency = efficiencies[len(calls) - 1]
        return EfficiencyRun(4_200_000, 4, SEQUENCES, TOKENS, 0.2, 0.3, 5e9, 0.02, efficiency, 0.005, 0.5)

    monkeypatch.setattr(calibration, "measure_machine", lambda: dict(MACHINE))
    monkeypatch.setattr(calibration, "measure_efficiency", run)
    return calls


def test_plan_prints_the_cached_efficiency_and_recalibrate_replaces_it(tmp_path, cache, capsys, monkeypatch):
    calls = fake_runs(monkeypatch, [0.3, 0.6])
    path = tmp_path / "config.json"
    LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).to_json_file(path)

    def plan(flag: str) -> str:
        main(["plan", "--model_config", str(path), "--block_size", "16", flag])
        return " ".join(capsys.readouterr().out.split())

    source = ("measured on this machine: a 4.2M-parameter Llama, 4 x 128 tokens, 0.2 s a step as one micro-batch "
              "(one thread's CPU time), 0.3 s as 4, MFU 50.0%")
    assert f"at efficiency 0.3 of peak for matmuls ({source})" in plan("--calibrate")
    assert json.loads(cache.read_text())["run"]["efficiency"] == 0.3
    assert "at efficiency 0.3 of peak" in plan("--calibrate") and len(calls) == 1  # read from the cache
    assert "at efficiency 0.6 of peak" in plan("--recalibrate") and len(calls) == 2
    assert "at efficiency 0.6 of peak" in plan("--calibrate") and len(calls) == 2
    assert json.loads(cache.read_text())["device"]["efficiency"] == 0.6


def test_a_cache_from_before_the_efficiency_run_is_measured_again(cache, monkeypatch):
    calls = fake_runs(monkeypatch, [0.4])
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({**MACHINE, "efficiency": 1.0}))  # version 1: flat, efficiency assumed 1
    assert calibrate().efficiency == 0.4 and len(calls) == 1
    assert json.loads(cache.read_text())["version"] == calibration.CACHE_VERSION


def test_calibrate_measures_this_machine(cache):
    """The whole calibration, unreplaced: gloo's workers forked, the run timed, everything cached."""
    device = calibrate()
    assert 0 < device.efficiency <= 1 and device.efficiency_source.startswith("measured on this machine")
    assert device.microbatch_overhead > 0
    assert device.flops_fp32 > 0 and device.intra_bandwidth > 0 and {op for op, _ in device.op_speed} == {
        "all_gather", "reduce_scatter"}
    # the operations a CPU runs below its bandwidth, each timed, and sdpa's math path under attention dropout
    assert dict(device.op_bandwidth).keys() == TIMED_OPS.keys() and all(b > 0 for _, b in device.op_bandwidth)
    assert min(b for _, b in device.op_bandwidth) < device.memory_bandwidth and not device.fused_attention_dropout
    assert 0 < device.latency < 0.1  # a small all-reduce after compute: the other rank's wait included
    record = json.loads(cache.read_text())
    assert record["run"]["efficiency"] == device.efficiency and calibrate() == device
