"""This machine as a ``Device`` (``plait plan --calibrate``): measured once, then read from a cache.

``machine.measure_machine`` (the CPU) or ``machine.measure_accelerator`` (the accelerator torch finds) gives the
peaks and the bandwidths. A matmul's peak leaves out what a training step spends besides: per-op framework
overhead, the non-matmul kernels, the step's fixed costs (on this CPU they made the planner's step times about half
the measured ones at efficiency 1). So the efficiency is measured, not assumed: a short training run (a
``Workload``: a small Llama in fp32 on one CPU thread, a 0.37B one in bf16 with fp32 masters on an accelerator) is
timed, and the efficiency is the one at which the planner's own step-time model (``LayoutEstimate.step_time``:
matmul FLOPs / (peak x efficiency) plus the modelled memory traffic) gives the measured step. The same batch is
timed again as several micro-batches: the difference is what each micro-batch costs beyond its FLOPs
(``Device.microbatch_overhead``), which makes the search weigh micro-batch size against accumulation by
measurement. The cache is versioned and names what it measured: one written by an older calibration, or of
another device, is measured again. A CPU's ranks share the host's memory (``per_node`` of them, one a core), so the
``Device`` a CPU's cache gives has each rank's share (``rank_share``); an accelerator's memory is each device's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

from plait.base.config import ParallelConfig
from plait.base.device import accelerator, describe_accelerator, use_fused_adamw
from plait.base.host_memory import keep_freed_memory
from plait.base.meta import build_meta_model
from plait.checkpoint.materialize import load_parallel_model
from plait.costs import machine
from plait.costs.activations import trace_activations
from plait.costs.device import CPU_RESERVE, Device
from plait.costs.estimate import Batch, LayoutEstimate, estimate_layout
from plait.costs.machine import measure_accelerator, measure_machine, one_thread
from plait.costs.memory import Precision
from plait.layout_plan import plan_layout
from plait.optim import OptimizerStep, build_optimizer
from plait.parallel_model import ParallelModel
from plait.plugin.registry import default_registry
from plait.run.model_config import DEFAULT_MODEL_CONFIG

# 6: the accelerator measured where there is one, the cache naming what it measured; 5: latency measured in a step
# (after compute); 4: non-matmul traffic counted by operation (``traffic``); 3: the per-micro-batch overhead
# measured too; 2: efficiency measured; unversioned: assumed
CACHE_VERSION = 6
# The CPU's run: plait's tiny Llama at twice its width, the size of bench/plan_check.py's timed Llama, whose step
# (4 x 128 tokens) takes about 0.3 s on one thread of a 2-core CPU, timed twice: as one micro-batch, and as
# SEQUENCES micro-batches of one sequence (gradient accumulation); the median of the timed steps of each, after
# the first steps (allocator and kernel warm-up) are dropped.
WIDTH, SEQUENCES, TOKENS, WARMUP, STEPS = 2, 4, 128, 2, 5
# The accelerator's: ``accelerator_config``'s 0.37B Llama at 4 x 2048 tokens, in bf16 with fp32 masters, the
# median of 20 steps (0.05-0.06 s each on an H200: of two calibrations of 5 steps, one timed the split run 0.082 s
# against the other's 0.062), split in 2 micro-batches of 4096 tokens. Split in 4 of 2048, each micro-batch's GPU
# work (about 7 ms) was near the CPU's time to launch it, and the split run took 0.063-0.074 s in four calibrations
# (the whole one 0.0463-0.0465), an overhead of 1.4-2.3 ms a layer; the planner then put the 1.24B Llama's splits
# (16 layers, GPU-bound) up to 1.49x their measured steps.
ACCELERATOR_TOKENS, ACCELERATOR_WARMUP, ACCELERATOR_STEPS, ACCELERATOR_SPLIT = 2048, 3, 20, 2


@dataclass(frozen=True)
class Workload:
    """What the calibration times: ``config``'s model trained on ``sequences`` x ``tokens`` a step, as one
    micro-batch and as ``split`` micro-batches (gradient accumulation), in ``precision`` (``plait train``'s: fp32,
    or ``--bf16``'s bf16 parameters with fp32 masters), the median of ``steps`` after ``warmup``."""

    config: PretrainedConfig
    sequences: int = SEQUENCES
    tokens: int = TOKENS
    precision: Precision = Precision()
    warmup: int = WARMUP
    steps: int = STEPS
    split: int = SEQUENCES

    def __post_init__(self) -> None:
        if self.sequences % self.split:
            raise ValueError(f"split={self.split} micro-batches do not divide sequences={self.sequences}")

    def describe(self) -> str:
        parameters = sum(p.numel() for p in build_meta_model(self.config).parameters())
        dtype = "bf16 with fp32 masters" if self.precision.masters else "fp32"
        return f"a {parameters / 1e6:.1f}M-parameter Llama in {dtype}, {self.sequences} x {self.tokens} tokens"


def workload_for(target: torch.device) -> Workload:
    """The CPU's run (``run_config``), or the accelerator's (``accelerator_config``)."""
    if target.type == "cpu":
        return Workload(run_config())
    return Workload(accelerator_config(), SEQUENCES, ACCELERATOR_TOKENS, Precision(torch.bfloat16, torch.float32),
                    ACCELERATOR_WARMUP, ACCELERATOR_STEPS, ACCELERATOR_SPLIT)


@dataclass(frozen=True)
class EfficiencyRun:
    """Two timed training runs of one batch and what the planner's model needs to give both step times."""

    workload: str  # ``Workload.describe``
    clock: str  # what the seconds are
    layers: int
    step_seconds: float  # one micro-batch: the median of the timed steps
    split_step_seconds: float  # the same batch as ``microbatches`` micro-batches
    microbatches: int  # of the split run
    flops: float  # matmul FLOPs of one step, the planner's count (``estimate._step_flops``)
    rest_seconds: float  # what the planner adds to the matmuls: activation and optimizer memory traffic
    efficiency: float
    microbatch_overhead: float  # seconds per micro-batch per layer
    mfu: float  # the one-micro-batch step's FLOPs per second over the matmul peak

    def describe(self) -> str:
        return (f"measured on this machine: {self.workload}, {self.step_seconds:.3g} s a step as one micro-batch "
                f"({self.clock}), {self.split_step_seconds:.3g} s as {self.microbatches}, MFU {self.mfu:.1%}")


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait" / "calibration.json"


def calibrate(memory_bytes: int | None = None, refresh: bool = False) -> Device:
    """This machine as a ``Device``: its accelerator where torch finds one, else its CPU (measured once, then read
    from ``cache_path()``; ``refresh``: measure again)."""
    target = accelerator() or machine.CPU
    found = describe_accelerator() if target.type != "cpu" else None
    measured = found[0] if found is not None else target.type  # a cache of another device is not this one's
    path = cache_path()
    cached = json.loads(path.read_text()) if path.exists() and not refresh else {}
    if cached.get("version") == CACHE_VERSION and cached.get("measured") == measured:
        fields = cached["device"]
    else:
        if target.type == "cpu":
            fields, links = measure_machine(), "measured (gloo, 2 local processes)"
        else:
            fields, links = measure_accelerator(target)
        run = measure_efficiency(_device({**fields, "efficiency": 1.0}), target)
        fields = {**fields, "efficiency": run.efficiency, "efficiency_source": f"{run.describe()}; links {links}",
                  "microbatch_overhead": run.microbatch_overhead}
        _write(path, {"version": CACHE_VERSION, "measured": measured, "device": fields,
                      "run": dataclasses.asdict(run)})
    device = _cached(measured, fields)
    return dataclasses.replace(device, memory_bytes=memory_bytes) if memory_bytes else device


def cached_device(path: Path) -> Device:
    """The ``Device`` a calibration cache file holds (one copied from another machine: bench/gpu_headroom.py
    plans an earlier run's rows on it)."""
    record = json.loads(Path(path).read_text())
    return _cached(record.get("measured", "cpu"), record["device"])  # before version 6 only CPUs were measured


def _cached(measured: str, fields: dict) -> Device:
    """The ``Device`` of a cache's measured ``fields``: a CPU's as each rank's share of it (``rank_share``)."""
    device = _device(fields)
    return rank_share(device) if measured == "cpu" else device


def rank_share(host: Device) -> Device:
    """A CPU calibration as one rank's device: the host's memory (``host.memory_bytes``, what ``measure_machine``
    reads) shared by the ``per_node`` ranks a node runs, each keeping the cpu preset's reserve (``CPU_RESERVE``: the
    interpreter and libraries). Each rank counted with the whole host, a layout whose ranks together need more than
    the machine has was said to fit. Shared where the cache is read, not where the machine is measured: the cache
    keeps the host's memory, so one written before is read right without measuring again."""
    return dataclasses.replace(host, memory_bytes=host.memory_bytes // host.per_node, host_memory=host.memory_bytes,
                               reserve_bytes=CPU_RESERVE)


def on_node(device: Device, ranks: int) -> Device:
    """``device`` for a run of ``ranks`` processes on the node: a CPU calibration's host shared by those, where they
    are fewer than its cores (shared by one rank a core, a 16-core host running 2 ranks gave each a 16th of its
    memory and refused layouts that fit); any other device as it is."""
    if device.host_memory <= 0 or not 0 < ranks < device.per_node:
        return device
    return dataclasses.replace(device, memory_bytes=device.host_memory // ranks, per_node=ranks)


def _device(fields: dict) -> Device:
    """A ``Device`` from its JSON fields (``op_speed``'s and ``op_bandwidth``'s pairs come back as lists)."""
    return Device(**{**fields, "op_speed": tuple(map(tuple, fields.get("op_speed", ()))),
                     "op_bandwidth": tuple(map(tuple, fields.get("op_bandwidth", ())))})


def _write(path: Path, record: dict) -> None:
    """Atomically: a ``plait plan`` started meanwhile reads the old cache or the new, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(json.dumps(record))
    os.replace(tmp.name, path)


def measure_efficiency(device: Device, target: torch.device = machine.CPU,
                       work: Workload | None = None) -> EfficiencyRun:
    """Time ``work`` (``workload_for(target)``) on ``target`` and solve the planner's step time on ``device`` (the
    measured peaks and bandwidths) for the efficiency and the per-micro-batch overhead (``solve_step_model``)."""
    work = work or workload_for(target)
    whole, split = _timed_runs(work, (1, work.split), target)
    one, several = run_estimates(work, world=1)
    efficiency, overhead = solve_step_model(device, one, several, whole, split)
    low = work.precision.param != torch.float32
    at_peak = one.flops[0] / device.peak_flops(low)
    rest = one.step_time(dataclasses.replace(device, efficiency=1.0, microbatch_overhead=0.0)) - at_peak
    clock = "one thread's CPU time" if target.type == "cpu" else "wall clock"
    return EfficiencyRun(work.describe(), clock, work.config.num_hidden_layers, whole, split, work.split,
                         one.flops[0], rest, efficiency, overhead, at_peak / whole)


def run_estimates(work: Workload, world: int) -> tuple[LayoutEstimate, LayoutEstimate]:
    """The planner's estimates of ``work`` on ``world`` data-parallel processes: ``work.sequences`` x
    ``work.tokens`` per process as one micro-batch, and as ``work.split`` micro-batches."""
    meta = build_meta_model(work.config, work.precision.param)
    registry = default_registry()
    plan = plan_layout(meta, ParallelConfig(), world, registry)
    # a Llama without dropout: whether the attention kernel takes dropout changes nothing
    trace = trace_activations(meta, work.tokens, registry, plan.adapter, fused_dropout=False)
    return tuple(estimate_layout(meta, plan, batch, work.precision, trace)  # type: ignore[return-value]
                 for batch in (Batch(work.sequences, work.tokens),
                               Batch(work.sequences // work.split, work.tokens, work.split)))


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


def accelerator_config() -> LlamaConfig:
    """The accelerator's run: a Llama of bench/gpu.py's 1.24B widths (hidden 2048, MLP 8192, 32 heads of 64, 8 kv
    heads: the matmul shapes of a 1B-8B model's layers) with 4 layers and a 32k vocabulary, 0.37B parameters: 12 GB
    a step at 4 x 2048 tokens, a few seconds to time on a Hopper GPU."""
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=ACCELERATOR_TOKENS)
    config._attn_implementation = "sdpa"
    return config


def _timed_runs(work: Workload, splits: tuple[int, ...], target: torch.device = machine.CPU) -> list[float]:
    """Seconds of one training step of ``work`` on ``target`` as each of ``splits`` micro-batches (the median of
    its timed steps after its warm-up), the global random state left as it was. The splits take their steps in turns on
    one model, so a slow spell of the machine (or its warming up) hits every split alike: timed one after the
    other, the difference between splits (the per-micro-batch overhead, tens of ms) came out 0 in 3 of 7 runs.
    On the CPU the work runs on one thread, as each of torchrun's local processes does, and the seconds are this
    thread's CPU time (``machine.seconds_on``): what a step costs the machine, not how long a busy machine's
    scheduler kept it waiting (on a shared 2-core machine at load 5, wall time was 0.24-0.27 s a step, CPU time
    0.16-0.18 s); with nothing else running the two are equal, as one thread does all of a step's work."""
    cpu = target.type == "cpu"
    if cpu:  # as plait train's CPU processes run (``host_memory``)
        keep_freed_memory()
    forked = torch.random.fork_rng(devices=[] if cpu else [target], device_type=target.type)
    with forked, one_thread() if cpu else contextlib.nullcontext():
        torch.manual_seed(0)
        ids = torch.randint(0, work.config.vocab_size, (work.sequences, work.tokens)).to(target)
        pmodel = load_parallel_model(work.config, ParallelConfig(), dtype=work.precision.param, device=target)
        # plait's own optimizer step (the fused AdamW where torch has one, else its multi-tensor one), clipping by
        # the global norm
        optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, fused=use_fused_adamw(target),
                                    optimizer_dtype=work.precision.optimizer)
        step = OptimizerStep(pmodel.grad_sync, optimizer, 1.0)
        seconds: list[list[float]] = [[] for _ in splits]
        for _ in range(work.warmup + work.steps):
            for microbatches, times in zip(splits, seconds):
                chunks = ids.chunk(microbatches)
                times.append(machine.seconds_on(target, lambda: _train_step(pmodel, step, chunks)))
    return [statistics.median(times[work.warmup:]) for times in seconds]


def _train_step(pmodel: ParallelModel, step: OptimizerStep, microbatches: tuple[torch.Tensor, ...]) -> None:
    """One plait training step in one process: forward with the loss and backward of each micro-batch
    (gradients accumulated over the step's tokens), then the optimizer step."""
    items = sum(ids.numel() - ids.shape[0] for ids in microbatches)  # shifted labels: one fewer per sequence
    for ids in microbatches:
        loss = pmodel.train_step(ids, ids, num_items_in_batch=items)
    step(loss)
