"""Issue 30: ``plait plan --calibrate`` measures the efficiency from a short training run, caches it, and
``--recalibrate`` replaces it."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import pytest
import torch
from transformers import LlamaConfig

from plait.base.config import ParallelConfig
from plait.base.device import accelerator, describe_accelerator
from plait.base.meta import build_meta_model
from plait.cli import main
from plait.costs import calibration
from plait.costs import machine
from plait.costs.activations import trace_activations
from plait.costs.calibration import (SEQUENCES, TOKENS, EfficiencyRun, Workload, cache_path, calibrate,
                                     measure_efficiency)
from plait.costs.device import CPU_RESERVE, GiB, PRESETS
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.memory import Precision
from plait.costs.traffic import TIMED_OPS
from plait.layout_plan import plan_layout
from plait.plugin.registry import default_registry
from processes import run as run_command

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
    one, several = calibration.run_estimates(Workload(calibration.run_config()), world=2)
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
    monkeypatch.setattr(machine, "time", clock)

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
    suite_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the runs' one thread (nor the suite's: tests/conftest.py), so a leak would show
    try:
        state = torch.get_rng_state()
        calibration._timed_runs(Workload(calibration.run_config()), (1, 2))
        assert torch.equal(torch.get_rng_state(), state) and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(suite_threads)


def fake_runs(monkeypatch, efficiencies: list[float]) -> list[int]:
    """Measurements replaced: the machine by ``MACHINE``, each run by the next of ``efficiencies``; returns
    the list the runs are counted in."""
    calls: list[int] = []

    def run(device):
        assert device.efficiency == 1.0 and device.flops_fp32 == MACHINE["flops_fp32"]
        calls.append(1)
        efficiency = efficiencies[len(calls) - 1]
        return EfficiencyRun(Workload(calibration.run_config()).describe(), "one thread's CPU time", 4, 0.2, 0.3,
                             SEQUENCES, 5e9, 0.02, efficiency, 0.005, 0.5)

    monkeypatch.setattr(calibration, "accelerator", lambda: None)  # this machine's CPU, also on a GPU machine
    monkeypatch.setattr(calibration, "measure_machine", lambda: dict(MACHINE))
    monkeypatch.setattr(calibration, "measure_efficiency", lambda device, target: run(device))
    return calls


def test_plan_prints_the_cached_efficiency_and_recalibrate_replaces_it(tmp_path, cache, capsys, monkeypatch):
    calls = fake_runs(monkeypatch, [0.3, 0.6])
    path = tmp_path / "config.json"
    LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).to_json_file(path)

    def plan(flag: str) -> str:
        main(["plan", "--model_config", str(path), "--block_size", "16", flag])
        return " ".join(capsys.readouterr().out.split())

    source = ("measured on this machine: a 4.2M-parameter Llama in fp32, 4 x 128 tokens, 0.2 s a step as one "
              "micro-batch (one thread's CPU time), 0.3 s as 4, MFU 50.0%; links measured (gloo, 2 local processes)")
    assert f"at efficiency 0.3 of peak for matmuls ({source})" in plan("--calibrate")
    assert json.loads(cache.read_text())["run"]["efficiency"] == 0.3
    assert "at efficiency 0.3 of peak" in plan("--calibrate") and len(calls) == 1  # read from the cache
    assert "at efficiency 0.6 of peak" in plan("--recalibrate") and len(calls) == 2
    assert "at efficiency 0.6 of peak" in plan("--calibrate") and len(calls) == 2
    assert json.loads(cache.read_text())["device"]["efficiency"] == 0.6


def test_a_cpus_ranks_share_the_hosts_memory_each_less_the_cpu_reserve(tmp_path, cache, capsys, monkeypatch):
    """On a CPU the ranks of a node share the host's memory: each of 2 gets half of it less the cpu preset's
    reserve, so a layout of 2 ranks that needs more than that is refused where 1 rank a node fits (the host's memory
    was each rank's, with no reserve: 2 ranks of 12.6 GiB fitted a 23.5 GiB host); the printed fit says so."""
    fake_runs(monkeypatch, [0.5, 0.5, 0.5])
    path = tmp_path / "config.json"
    model_config_tiny().to_json_file(path)

    def plan(*flags: str) -> str:
        main(["plan", "--model_config", str(path), "--block_size", "16", "--world_size", "2", *flags])
        return capsys.readouterr().out

    peak = json.loads(plan("--hardware", "cpu", "--json"))["peak"]
    # 2 ranks a node get 0.75 x the peak each, 1 rank 1.5 x + 0.5 GiB (in place of the host's memory measured)
    host = 2 * CPU_RESERVE + int(1.5 * peak)
    machine_of = {"per_node": 2}
    monkeypatch.setattr(calibration, "measure_machine", lambda: {**MACHINE, "memory_bytes": host, **machine_of})
    device = calibrate()
    assert device.usable_bytes == host // 2 - CPU_RESERVE and (device.memory_bytes, device.host_memory) == (
        host // 2, host)
    shared = json.loads(plan("--calibrate", "--json"))
    assert shared["usable_memory"] == host // 2 - CPU_RESERVE < peak and shared["fits"] is False
    line = " ".join(plan("--calibrate").split())
    assert (f"of {(host // 2 - CPU_RESERVE) / GiB:.2f} GiB usable per device ({host / GiB:.2f} GiB shared by 2 "
            f"ranks: {host // 2 / GiB:.2f} GiB each, less 0.50 GiB kept for") in line and "does not fit" in line
    machine_of["per_node"] = 1
    alone = json.loads(plan("--recalibrate", "--json"))
    assert alone["usable_memory"] == host - CPU_RESERVE > peak and alone["fits"] is True
    assert calibration.cached_device(cache).usable_bytes == host - CPU_RESERVE
    machine_of["per_node"] = 4  # more cores than the run's 2 ranks: the host shared by those 2, not a 4th each
    assert json.loads(plan("--recalibrate", "--json"))["usable_memory"] == host // 2 - CPU_RESERVE


def test_a_cache_from_before_the_efficiency_run_is_measured_again(cache, monkeypatch):
    calls = fake_runs(monkeypatch, [0.4])
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({**MACHINE, "efficiency": 1.0}))  # version 1: flat, efficiency assumed 1
    assert calibrate().efficiency == 0.4 and len(calls) == 1
    assert json.loads(cache.read_text())["version"] == calibration.CACHE_VERSION


@pytest.mark.skipif(accelerator() is not None, reason="a machine with an accelerator calibrates that, not its CPU")
def test_calibrate_measures_this_machine(cache, tmp_path, monkeypatch):
    """The whole calibration, unreplaced, as ``plait plan --calibrate`` runs it (gloo's workers forked, the run
    timed, everything cached), read back here; the command prints its own lines only (the workers' deprecated
    collectives once put 4 torch FutureWarnings among them). A command, not ``calibrate()`` in this process: under
    pytest's warnings capture a forked worker's warning is recorded in the fork, never printed."""
    model_config_tiny().to_json_file(tmp_path / "config.json")
    done = run_command([sys.executable, "-m", "plait", "plan", "--model_config", str(tmp_path / "config.json"),
                        "--block_size", "16", "--calibrate"], timeout=300)
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stderr
    monkeypatch.setattr(calibration, "measure_machine", lambda: pytest.fail("the command's calibration not cached"))
    device = calibrate()
    assert device.describe_efficiency() in " ".join(done.stdout.split())  # what the command measured and used
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


def test_a_bf16_workload_with_masters_gives_both_steps_at_the_bf16_peak():
    """The accelerator's workload (bf16 parameters, fp32 masters and AdamW state; ``workload_for``), run on the CPU
    at a small size: the planner, at the solved values and the bf16 peak, gives both measured steps."""
    config = model_config_tiny()
    work = Workload(config, 2, 64, Precision(torch.bfloat16, torch.float32), split=2)
    run = measure_efficiency(FAST, machine.CPU, work)
    assert 0 < run.efficiency < 1 and "in bf16 with fp32 masters, 2 x 64 tokens" in run.workload
    one, several = calibration.run_estimates(work, world=1)
    solved = dataclasses.replace(FAST, efficiency=run.efficiency, microbatch_overhead=run.microbatch_overhead)
    assert one.precision.masters and one.step_time(solved) == pytest.approx(run.step_seconds, rel=1e-9)
    assert several.step_time(solved) == pytest.approx(run.split_step_seconds, rel=1e-9)


def model_config_tiny() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_where_torch_finds_an_accelerator_it_is_measured_and_cached_by_its_name(cache, monkeypatch):
    """``calibrate`` measures the accelerator (not the CPU) where torch finds one, names it in the cache, and
    measures again when the cache holds another device's figures (a CPU's, or another card's)."""
    gpu = torch.device("cuda")  # never touched: the measurements are replaced
    found = {"name": "nvidia h100 80gb hbm3"}
    monkeypatch.setattr(calibration, "accelerator", lambda: gpu)
    monkeypatch.setattr(calibration, "describe_accelerator", lambda: (found["name"], 80 * 2**30))
    measured: list[str] = []

    def accelerator_fields(target):
        assert target == gpu
        measured.append(found["name"])
        return {**MACHINE, "name": f"{found['name']} (calibrated)", "fused_adamw": True}, "the h100 preset's"

    monkeypatch.setattr(calibration, "measure_accelerator", accelerator_fields)
    monkeypatch.setattr(calibration, "measure_machine", lambda: pytest.fail("the CPU measured beside a GPU"))
    monkeypatch.setattr(calibration, "measure_efficiency", lambda device, target: EfficiencyRun(
        "a 0.4B Llama", "wall clock", 4, 0.05, 0.06, 4, 1e13, 0.01, 0.7, 0.001, 0.6))
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"version": calibration.CACHE_VERSION, "measured": "cpu",
                                 "device": {**MACHINE, "efficiency": 0.3}}))
    device = calibrate()
    assert device.efficiency == 0.7 and device.name == "nvidia h100 80gb hbm3 (calibrated)" and device.fused_adamw
    assert device.efficiency_source.endswith("(wall clock), 0.06 s as 4, MFU 60.0%; links the h100 preset's")
    assert json.loads(cache.read_text())["measured"] == "nvidia h100 80gb hbm3"
    assert device.memory_bytes == MACHINE["memory_bytes"] and not device.shares_host  # each device's own
    assert calibrate() == device and measured == ["nvidia h100 80gb hbm3"]  # read from the cache
    found["name"] = "nvidia l40s"
    assert calibrate().name == "nvidia l40s (calibrated)" and len(measured) == 2


def test_an_accelerators_links_are_its_presets_else_assumed_and_said(monkeypatch):
    """One device has no link to time: a card a preset names gets the preset's links and devices per node, another
    ``ASSUMED_LINKS``, and the source says which. The device measurements run here on CPU tensors, small."""
    for name, size in (("_matmul_flops", 128), ("_copy_bandwidth", 2**16), ("_op_bandwidth", 2**16)):
        real = getattr(machine, name)
        monkeypatch.setattr(machine, name, lambda *args, real=real, size=size: real(*args[:-1], size))
    monkeypatch.setattr(machine, "describe_accelerator", lambda: ("nvidia h200", 140 * 2**30))
    fields, source = machine.measure_accelerator(machine.CPU)
    h200 = PRESETS["h200"]
    assert source == "the h200 preset's" and fields["memory_bytes"] == 140 * 2**30
    assert (fields["intra_bandwidth"], fields["per_node"], fields["latency"]) == (
        h200.intra_bandwidth, h200.per_node, h200.latency)
    assert fields["flops_bf16"] > 0 and fields["memory_bandwidth"] > 0 and fields["reserve_bytes"] > 0
    assert dict(fields["op_bandwidth"]).keys() == TIMED_OPS.keys()
    monkeypatch.setattr(machine, "describe_accelerator", lambda: ("some new card", 24 * 2**30))
    fields, source = machine.measure_accelerator(machine.CPU)
    assert source.startswith("assumed") and fields["intra_bandwidth"] == machine.ASSUMED_LINKS["intra_bandwidth"]
    assert calibration._device({**fields, "efficiency": 1.0}).name == "some new card (calibrated)"


@pytest.mark.skipif(accelerator() is None, reason="needs an accelerator (run on a GPU machine; CI has none)")
def test_calibrate_measures_the_accelerator(cache):
    """The whole calibration on the accelerator torch finds, unreplaced: the device's own peaks and memory, the
    0.37B Llama's two runs, and the planner giving both measured steps at the solved values."""
    device = calibrate()
    name, memory = describe_accelerator()
    assert device.name == f"{name} (calibrated)" and device.memory_bytes == memory and device.fused_adamw
    assert device.flops_bf16 > device.flops_fp32 > 0 and 0 < device.efficiency <= 1
    assert device.microbatch_overhead >= 0 and device.fused_attention_dropout
    record = json.loads(cache.read_text())
    assert record["measured"] == name and record["run"]["clock"] == "wall clock"
    work = calibration.workload_for(accelerator())
    one, several = calibration.run_estimates(work, world=1)
    assert one.step_time(device) == pytest.approx(record["run"]["step_seconds"], rel=1e-6)
    if device.microbatch_overhead > 0:
        assert several.step_time(device) == pytest.approx(record["run"]["split_step_seconds"], rel=1e-6)
    print(json.dumps(record))
