"""This machine as a ``Device`` (``plait plan --calibrate``): measured once, then read from a cache.

``device.measure_machine`` gives the peak (a one-thread matmul) and the bandwidths. A matmul's peak leaves out what
a training step spends besides: per-op framework overhead, the non-matmul kernels, the step's fixed costs (on this
CPU they made the planner's step times about half the measured ones at efficiency 1). So the efficiency is measured,
not assumed: a short training run of a small Llama on one thread is timed, and the efficiency is the one at which
the planner's own step-time model (``LayoutEstimate.step_time``: matmul FLOPs / (peak x efficiency) plus the
modelled memory traffic) gives the measured step. The same batch is timed again as several micro-batches: the
difference is what each micro-batch costs beyond its FLOPs (``Device.microbatch_overhead``), which makes the search
weigh micro-batch size against accumulation by measurement. The cache is versioned: one written by an older
calibration is measured again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from plait.config import ParallelConfig
from plait.costs.activations import trace_activations
from plait.costs.device import Device, measure_machine, one_thread
from plait.costs.estimate import Batch, LayoutEstimate, estimate_layout
from plait.costs.memory import Precision
from plait.layout_plan import plan_layout
from plait.meta import build_meta_model
from plait.model_config import DEFAULT_MODEL_CONFIG
from plait.optim import OptimizerStep, build_optimizer
from plait.parallelize import ParallelModel, parallelize
from plait.registry import default_registry

# 5: latency measured in a step (after compute); 4: non-matmul traffic counted by operation (``traffic``); 3: the
# per-micro-batch overhead measured too; 2: efficiency measured; unversioned: assumed
CACHE_VERSION = 5
# The run: plait's tiny Llama at twice its width, the size of bench/plan_check.py's timed Llama, whose step
# (4 x 128 tokens) takes about 0.3 s on one thread of a 2-core CPU, timed twice: as one micro-batch, and as
# SEQUENCES micro-batches of one sequence (gradient accumulation); the median of the timed steps of each, after
# the first steps (allocator and kernel warm-up) are dropped.
WIDTH, SEQUENCES, TOKENS, WARMUP, STEPS = 2, 4, 128, 2, 5


@dataclass(frozen=True)
class EfficiencyRun:
    """Two timed training runs of one batch and what the planner's model needs to give both step times."""

    parameters: int
    layers: int
    sequences: int
    tokens: int  # per sequence
    step_seconds: float  # one micro-batch of ``sequences``: the median of the timed steps, in CPU time
    split_step_seconds: float  # the same batch as ``sequences`` micro-batches of one sequence
    flops: float  # matmul FLOPs of one step, the planner's count (``estimate._step_flops``)
    rest_seconds: float  # what the planner adds to the matmuls: activation and optimizer memory traffic
    efficiency: float
    microbatch_overhead: float  # seconds per micro-batch per layer
    mfu: float  # the one-micro-batch step's FLOPs per second over the matmul peak

    def describe(self) -> str:
        return (f"measured on this machine: a {self.parameters / 1e6:.1f}M-parameter Llama, {self.sequences} x "
                f"{self.tokens} tokens, {self.step_seconds:.3g} s a step as one micro-batch (one thread's CPU time), "
                f"{self.split_step_seconds:.3g} s as {self.sequences}, MFU {self.mfu:.1%}")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait" / "calibration.json"


def calibrate(memory_bytes: int | None = None, refresh: bool = False) -> Device:
    """This machine as a ``Device`` (measured once, then read from ``cache_path()``; ``refresh``: measure again)."""
    path = cache_path()
    cached = json.loads(path.read_text()) if path.exists() and not refresh else {}
    if cached.get("version") == CACHE_VERSION:
        fields = cached["device"]
    else:
        fields = measure_machine()
        run = measure_efficiency(_device({**fields, "efficiency": 1.0}))
        fields = {**fields, "efficiency": run.efficiency, "efficiency_source": run.describe(),
                  "microbatch_overhead": run.microbatch_overhead}
        _write(path, {"version": CACHE_VERSION, "device": fields, "run": dataclasses.asdict(run)})
    device = _device(fields)
    return dataclasses.replace(device, memory_bytes=memory_bytes) if memory_bytes else device


def _device(fields: dict) -> Device:
    """A ``Device`` from its JSON fields (``op_speed``'s and ``op_bandwidth``'s pairs come back as lists)."""
    return Device(**{**fields, "op_speed": tuple(map(tuple, fields["op_speed"])),
                     "op_bandwidth": tuple(map(tuple, fields.get("op_bandwidth", ())))})


def _write(path: Path, record: dict) -> None:
    """Atomically: a ``plait plan`` started meanwhile reads the old cache or the new, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(json.dumps(record))
    os.replace(tmp.name, path)


def measure_efficiency(device: Device) -> EfficiencyRun:
    """Time the run on this machine's CPU and solve the planner's step time on ``device`` (the measured peak and
    bandwidths) for the efficiency and the per-micro-batch overhead (``solve_step_model``)."""
    config = run_config()
    whole, split = _timed_runs(config, (1, SEQUENCES))
    one, several = run_estimates(config, world=1)
    efficiency, overhead = solve_step_model(device, one, several, whole, split)
    at_peak = one.flops[0] / device.peak_flops(low_precision=False)
    rest = one.step_time(dataclasses.replace(device, efficiency=1.0, microbatch_overhead=0.0)) - at_peak
    parameters = sum(p.numel() for p in build_meta_model(config).parameters())
    return EfficiencyRun(parameters, config.num_hidden_layers, SEQUENCES, TOKENS, whole, split, one.flops[0], rest,
                         efficiency, overhead, at_peak / whole)


def run_estimates(config: PretrainedConfig, world: int) -> tuple[LayoutEstimate, LayoutEstimate]:
    """The planner's estimates of the calibration run on ``world`` data-parallel processes: ``SEQUENCES`` x
    ``TOKENS`` per process as one micro-batch, and as ``SEQUENCES`` micro-batches of one sequence."""
    meta = build_meta_model(config)
    registry = default_registry()
    plan = plan_layout(meta, ParallelConfig(), world, registry)
    trace = trace_activations(meta, TOKENS, registry, plan.adapter, fused_dropout=False)  # this CPU
    return tuple(estimate_layout(meta, plan, batch, Precision(), trace)  # type: ignore[return-value]
                 for batch in (Batch(SEQUENCES, TOKENS), Batch(1, TOKENS, SEQUENCES)))


def solve_step_model(device: Device, one: LayoutEstimate, several: LayoutEstimate, one_seconds: float,
                     several_seconds: float) -> tuple[float, float]:
    """(efficiency, per-micro-batch overhead) at which the planner's step time on ``device`` gives both measured
    steps: one batch as ``one``'s micro-batches and as ``several``'s more. A step of m micro-batches takes
    FLOPs / (peak x efficiency) + rest + m x layers x overhead, the rest being what the model adds at any efficiency
    (memory traffic, communication); the FLOPs are the same however the batch is split. A step faster than the
    model's at peak is taken at peak (efficiency at most 1)."""
    bare = dataclasses.replace(device, efficiency=1.0, microbatch_overhead=0.0)
    at_peak = one.flops[0] / device.peak_flops(one.precision.param != torch.float32)
    rest_one, rest_several = one.step_time(bare) - at_peak, several.step_time(bare) - at_peak
    count = lambda e: e.plan.config.num_microbatches * e.batch.accumulation  # noqa: E731
    layers = max(one.layers.values())
    extra = (several_seconds - rest_several) - (one_seconds - rest_one)
    overhead = max(extra, 0.0) / ((count(several) - count(one)) * layers)
    efficiency = at_peak / max(one_seconds - rest_one - count(one) * layers * overhead, at_peak)
    return efficiency, overhead


def run_config() -> PretrainedConfig:
    """plait's tiny Llama (the bundled config) at ``WIDTH`` times its hidden and MLP width (as many heads, each
    ``WIDTH`` times as wide: the config derives its head width when built, so the JSON is scaled, not the config)."""
    values = json.loads(resources.files("plait.configs").joinpath(DEFAULT_MODEL_CONFIG).read_text())
    values.update(hidden_size=values["hidden_size"] * WIDTH, intermediate_size=values["intermediate_size"] * WIDTH)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _timed_runs(config: PretrainedConfig, splits: tuple[int, ...]) -> list[float]:
    """Seconds of one training step of ``config``'s model on ``SEQUENCES`` x ``TOKENS`` tokens as each of ``splits``
    micro-batches (median of ``STEPS`` after ``WARMUP``), one thread, the global random state left as it was. Each
    split trains a model of its own, their steps taken in turns, so a slow spell of the machine (or its warming
    up) hits every split alike: timed one after the other, the difference between splits (the per-micro-batch
    overhead, tens of ms) came out 0 in 3 of 7 runs. The seconds are this thread's CPU time: what a step costs the
    machine, not how long a busy machine's scheduler kept it waiting (on a shared 2-core machine at load 5, wall
    time was 0.24-0.27 s a step, CPU time 0.16-0.18 s); with nothing else running the two are equal, as one thread
    does all of a step's work (intra-op and autograd's CPU work run on the caller)."""
    with torch.random.fork_rng(devices=[]), one_thread():
        torch.manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (SEQUENCES, TOKENS))
        runs = []
        for microbatches in splits:
            pmodel = parallelize(AutoModelForCausalLM.from_config(config), ParallelConfig())  # one process
            # plait's own optimizer step (torch's multi-tensor AdamW on the CPU), clipping by the global norm
            step = OptimizerStep(pmodel.grad_sync, build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4), 1.0)
            runs.append((pmodel, step, ids.chunk(microbatches)))
        seconds: list[list[float]] = [[] for _ in splits]
        for _ in range(WARMUP + STEPS):
            for (pmodel, step, microbatches), times in zip(runs, seconds):
                start = time.thread_time()
                _train_step(pmodel, step, microbatches)
                times.append(time.thread_time() - start)
    return [statistics.median(times[WARMUP:]) for times in seconds]


def _train_step(pmodel: ParallelModel, step: OptimizerStep, microbatches: tuple[torch.Tensor, ...]) -> None:
    """One plait training step in one process: forward with the loss and backward of each micro-batch
    (gradients accumulated over the step's tokens), then the optimizer step."""
    items = sum(ids.numel() - ids.shape[0] for ids in microbatches)  # shifted labels: one fewer per sequence
    for ids in microbatches:
        loss = pmodel.train_step(ids, ids, num_items_in_batch=items)
    step(loss)
