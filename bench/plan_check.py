"""``plait plan`` against measurement, side by side in one run (issue 14's acceptance), on 2 CPU ranks (gloo).

    python bench/plan_check.py [--tiny] [--steps 3] [--only bytes|memory|time] [--no-calibrate]

1. Bytes: parameters, gradients, optimizer state that built ranks hold vs the planner, per rank and layout
   (tp, ZeRO-1 with weight-decay groups, pp, bf16 with fp32 masters): must be equal.
2. Peak memory over the post-load baseline, per rank, for 15 layouts of a Llama whose activations dominate
   (eager attention, s=256), and 4 of a Mixtral of the same size (moe_: dp, ep=2, ep=2 with ZeRO-1, tp=2 SP):
   within 20%. Measured as the kernel's resident-set high-water mark (VmHWM, reset
   through /proc/self/clear_refs before the step) minus the resident set before it, with glibc told to mmap
   every block over 64 KiB (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and
   RSS follows live tensor bytes; torch's CPU allocator does not cache. The prediction over that baseline is
   the planner's peak minus what the baseline already holds (parameters, optimizer state, fp32 main_grads).
   The first step (optimizer state, pipeline shape inference) runs before the baseline. The "saved" columns:
   bytes of the distinct tensors autograd saved in the step's forward (saved_tensors_hooks, by address) vs the
   planner's traced activations, which separates an activation error from a transient one (not under pp, where
   micro-batches reuse each other's addresses).
3. Communication: the planner's collectives beside those plait.base.comm counts in the measured step (ep's all-to-all
   bytes as the mean over ranks: routing moves them between ranks), and beside
   bench/tp_comm.py's formula for its model (counts and bytes equal); bubble beside bench/pp_bubble.py's formulas.
4. Step time with ``--calibrate``: for three models (a Llama at several batch shapes, a GPT-2, a Qwen3), the planner's 5 best layouts of 2 ranks (each with
   the micro-batch size and accumulation steps the search chose for it) are run; the planner's first, which is
   what ``plait train --layout auto`` trains with, must be within 10% of the fastest measured, and each planned step
   within 20% of its measured one. The times run in a world of their own, without the memory part's malloc setting.
   The calibration run (``costs.calibration``: its Llama, 4 x 128 tokens a rank, as one micro-batch and as 4) takes
   a turn, at dp=2, in the turns of every model and global batch, and the efficiency and per-micro-batch overhead
   solved from the run beside them give the planned steps held to 20%: this VM's speed drifts by up to 1.5x between minutes (the same one-process
   step measured 0.42-0.62 s), so a calibration cached minutes earlier leaves the comparison at the drift's mercy.
   The planned steps on the cached calibration are printed beside.
   Then the pick for each global batch written three ways (per device x accumulation) must be the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tp_comm, pp_bubble

MEMORY_LAYOUTS = {  # name -> ParallelConfig kwargs, on 2 ranks
    "dp2": {},
    "dp2_zero1": {"zero_1": True},
    "dp2_zero2": {"zero_stage": 2},  # FSDP2: every layer gathered for the step, then freed
    "dp2_zero3": {"zero_stage": 3},  # FSDP2: the root and two layers gathered at a time
    "dp2_recompute": {"gradient_checkpointing": True},
    "tp2_sp": {"tp": 2},
    "tp2_nosp": {"tp": 2, "sp": False},
    "tp2_sp_recompute": {"tp": 2, "gradient_checkpointing": True},
    "tp2_nosp_recompute": {"tp": 2, "sp": False, "gradient_checkpointing": True},
    "pp2_m2": {"pp": 2, "num_microbatches": 2},
    "pp2_m4": {"pp": 2, "num_microbatches": 4},
    "pp2_vpp2_m2": {"pp": 2, "virtual_pipeline_size": 2, "num_microbatches": 2,
                    "pipeline_schedule": "interleaved-1f1b"},
    "cp2_all_to_all": {"cp": 2, "cp_attention": "all-to-all"},
    "cp2_ring": {"cp": 2, "cp_attention": "ring"},
    "cp2_ring_recompute": {"cp": 2, "cp_attention": "ring", "gradient_checkpointing": True},
    # "moe_": a Mixtral of the same size instead (8 experts, top-2): its routed experts' activations and ep
    "moe_dp2": {},
    "moe_ep2": {"ep": 2},
    "moe_ep2_zero1": {"ep": 2, "zero_1": True},
    "moe_tp2_sp": {"tp": 2},
}
BYTES_LAYOUTS = {  # name -> (kwargs, bf16 parameters, weight decay)
    "tp2_wd": ({"tp": 2}, False, 0.1),
    "dp2_zero1_wd": ({"zero_1": True}, False, 0.1),
    "dp2_zero1_bf16": ({"zero_1": True}, True, 0.0),
    "pp2_bf16": ({"pp": 2, "num_microbatches": 2}, True, 0.0),
}
SHAPES = [(8, 128), (4, 256), (16, 64)]  # (sequences per rank at dp=2, tokens): the global batch is kept
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
CALIBRATION = "calibration"  # the time world's jobs of the calibration run


def model_config(tiny: bool, time_model: bool = False, moe: bool = False):
    from transformers import LlamaConfig, MixtralConfig

    if moe:
        config = MixtralConfig(vocab_size=1024, hidden_size=32 if tiny else 128, intermediate_size=64 if tiny else 256,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
        config._attn_implementation = "eager"
        return config
    if time_model:
        return LlamaConfig(vocab_size=2048, hidden_size=64 if tiny else 256, intermediate_size=128 if tiny else 768,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=256)
    config = LlamaConfig(vocab_size=1024, hidden_size=32 if tiny else 128, intermediate_size=64 if tiny else 256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    config._attn_implementation = "eager"
    return config


def time_models(tiny: bool) -> dict:
    """Section 4's models, each with its batch shapes: the Llama at three shapes (the invariance check's), a GPT-2
    (tied embeddings, fused qkv, learned positions) and a Qwen3 (q/k norms, GQA) at one."""
    from transformers import GPT2Config, Qwen3Config

    small = 64 if tiny else 256
    gpt2 = GPT2Config(vocab_size=2048, n_embd=small, n_layer=4, n_head=8, n_positions=256)
    qwen3 = Qwen3Config(vocab_size=2048, hidden_size=small, intermediate_size=3 * small, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=small // 8, max_position_embeddings=256)
    return {"llama": (model_config(tiny, time_model=True), SHAPES), "gpt2": (gpt2, SHAPES[:1]),
            "qwen3": (qwen3, SHAPES[:1]), CALIBRATION: (calibration_config(tiny), [])}


def calibration_config(tiny: bool):
    """The calibration run's model (``costs.calibration.run_config``), or plait's tiny Llama under ``--tiny``."""
    from plait.costs import calibration

    return calibration.run_config() if not tiny else model_config(True, time_model=True)


def calibration_jobs() -> dict[str, dict]:
    """The calibration run as two dp=2 jobs of the time world: one micro-batch of SEQUENCES, and SEQUENCES of one."""
    from plait.costs.calibration import SEQUENCES, TOKENS

    return {f"{CALIBRATION}|{SEQUENCES}x{TOKENS}x1|{{}}": {}, f"{CALIBRATION}|1x{TOKENS}x{SEQUENCES}|{{}}": {}}


def memory_seq(tiny: bool) -> tuple[int, int]:
    return (4, 64) if tiny else (8, 256)  # per-device batch, tokens


# ---------------------------------------------------------------------------------------------- worker side

def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _build(config_kwargs: dict, model_cfg, dtype, weight_decay: float = 0.0):
    import torch
    from transformers import AutoModelForCausalLM

    from plait import ParallelConfig, parallelize
    from plait.optim import OptimizerStep, build_optimizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_cfg).to(dtype)
    pmodel = parallelize(model, ParallelConfig(**config_kwargs))
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-4, weight_decay=weight_decay,
                                optimizer_dtype=torch.float32)
    return pmodel, optimizer, OptimizerStep(pmodel.grad_sync, optimizer, 1.0)


def _predict(config_kwargs: dict, model_cfg, dtype, per_device: int, seq: int, weight_decay: float = 0.0):
    import torch
    import torch.distributed as dist

    from plait import ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.costs.activations import trace_activations
    from plait.costs.estimate import Batch, estimate_layout
    from plait.costs.memory import Precision
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry

    registry = default_registry()
    meta = build_meta_model(model_cfg, dtype)
    plan = plan_layout(meta, ParallelConfig(**config_kwargs), dist.get_world_size(), registry)
    trace = trace_activations(meta, seq, registry, plan.adapter)
    return estimate_layout(meta, plan, Batch(per_device, seq), Precision(dtype, torch.float32), trace, weight_decay)


class _SavedBytes:
    """Bytes of the distinct tensors autograd saves while the context is open (parameters excluded): the
    activations of all micro-batches of a step, for comparing with the planner's per-micro-batch figure."""

    def __init__(self) -> None:
        self.total, self._seen = 0, set()

    def __enter__(self):
        import torch

        self._params = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def _pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if not isinstance(tensor, __import__("torch").nn.Parameter) and key not in self._seen:
            self._seen.add(key)
            self.total += tensor.untyped_storage().nbytes()
        return tensor

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _measure_bytes(kwargs: dict, bf16: bool, weight_decay: float, rank: int) -> dict:
    """Parameter, gradient (after backward) and optimizer (after the step) bytes of this rank, and the planner's."""
    import torch

    from plait.costs.measure import gradient_bytes, optimizer_bytes, parameter_bytes

    dtype = torch.bfloat16 if bf16 else torch.float32
    b, s = memory_seq(True)
    cfg = model_config(True)
    predicted = _predict(kwargs, cfg, dtype, b, s, weight_decay).for_rank(rank).static
    pmodel, optimizer, step = _build(kwargs, cfg, dtype, weight_decay)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(rank))
    pmodel.train_step(ids, ids, num_items_in_batch=b * (s - 1) * pmodel.mesh.dp)
    grads = gradient_bytes(pmodel)
    step()
    return {"measured": [parameter_bytes(pmodel), grads, optimizer_bytes(optimizer)],
            "predicted": [predicted.parameters, predicted.gradients, predicted.optimizer]}


def _measure_memory(kwargs: dict, tiny: bool, rank: int, moe: bool = False) -> dict:
    """One layout's peak over the post-load baseline on this rank, beside the planner's (module docstring)."""
    import gc

    import torch
    import torch.distributed as dist

    from plait.base.comm import count_collectives

    b, s = memory_seq(tiny)
    cfg = model_config(tiny, moe=moe)
    estimate = _predict(kwargs, cfg, torch.float32, b, s)
    mine = estimate.for_rank(rank)
    pmodel, _, step = _build(kwargs, cfg, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(rank))
    items = b * (s - 1) * pmodel.mesh.dp

    def one_step():
        pmodel.train_step(ids, ids, num_items_in_batch=items)
        step()

    one_step()  # optimizer state, pipeline shapes
    gc.collect()
    dist.barrier()
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    with count_collectives() as counter, _SavedBytes() as saved:
        one_step()
    peak = _status("VmHWM") - baseline
    held = mine.static.parameters + mine.static.optimizer + (mine.static.gradients if estimate.precision.masters else 0)
    return {"measured": peak, "predicted": mine.peak - held, "activations": mine.activations.in_flight,
            "saved": saved.total, "saved_per_microbatch": mine.activations.per_microbatch, "records": counter.records,
            "planned_comm": [[op.group, op.op, op.count, op.bytes] for op in estimate.comm[mine.pp_rank]]}


def _time_layouts(jobs: dict, tiny: bool, steps: int) -> dict[str, float]:
    """Median seconds per step of each job ("MODEL|BxSxA|layout" -> ParallelConfig kwargs: micro-batch B of S
    tokens, A accumulation steps). The layouts of one model and global batch (``time_group``) are built together
    and timed in turns (round-robin), so a slow spell of a shared machine hits them all; the calibration run's two
    jobs take a turn in every group, timed as "GROUP@JOB", so each group has a calibration measured beside it."""
    import gc

    import torch.distributed as dist

    from plait.base.host_memory import keep_freed_memory

    keep_freed_memory()  # as plait train's CPU processes run
    rank = dist.get_rank()
    models = time_models(tiny)
    calibration = [key for key in jobs if key.startswith(CALIBRATION + "|")]
    groups: dict[str, list[str]] = {}
    for key in jobs:
        if key not in calibration:
            groups.setdefault(time_group(key), []).append(key)
    reference = {key: _timed_job(key, jobs[key], models, rank) for key in calibration}
    times: dict[str, list[float]] = {}
    for group, keys in groups.items():
        built = {key: _timed_job(key, jobs[key], models, rank) for key in keys}
        built |= {f"{group}@{key}": job for key, job in reference.items()}
        for turn in range(steps + 1):  # turn 0 warms up
            for key, (pmodel, step, ids, accumulation, items) in built.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(accumulation):
                    pmodel.train_step(ids, ids, num_items_in_batch=items)
                step()
                dist.barrier()
                if turn:
                    times.setdefault(key, []).append(time.perf_counter() - start)
        del built
        gc.collect()
    return {key: statistics.median(t) for key, t in times.items()}


def time_group(key: str) -> str:
    """"MODEL|sequences per step x tokens" of a job: the layouts of one model and global batch, however split."""
    name, shape, kwargs = key.split("|", 2)
    b, s, accumulation = (int(x) for x in shape.split("x"))
    layout = json.loads(kwargs)
    dp = 2 // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    return f"{name}|{b * accumulation * dp}x{s}"


def _timed_job(key: str, kwargs: dict, models: dict, rank: int) -> tuple:
    """(model, optimizer step, this rank's ids, accumulation steps, tokens scored per step) of one job."""
    import torch

    name, shape, _ = key.split("|", 2)
    cfg = models[name][0]
    b, s, accumulation = (int(x) for x in shape.split("x"))
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(rank))
    pmodel, _, step = _build(kwargs, cfg, torch.float32)
    return pmodel, step, ids, accumulation, b * (s - 1) * pmodel.mesh.dp * accumulation


def worker(out: str, tiny: bool, steps: int, jobs: str) -> None:
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    results: dict = {"bytes": {}, "memory": {}, "time": {}}
    spec = json.loads(Path(jobs).read_text())
    for name, (kwargs, bf16, wd) in spec["bytes"].items():
        results["bytes"][name] = _measure_bytes(kwargs, bf16, wd, rank)
    for name, kwargs in spec["memory"].items():
        results["memory"][name] = _measure_memory(kwargs, tiny, rank, moe=name.startswith("moe_"))
        gc.collect()
    results["time"] = _time_layouts(spec["time"], tiny, steps)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- main side

def rank_layouts(tiny: bool, calibrate: bool):
    """(jobs: key -> ParallelConfig kwargs to time, the calibration run's two among them; per batch shape the
    planner's top 5 as (key, estimate, label); the device model used)."""
    import torch

    from plait import ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.costs.activations import trace_activations
    from plait.costs.calibration import calibrate as measure_device
    from plait.costs.device import PRESETS
    from plait.costs.estimate import Batch
    from plait.costs.memory import Precision
    from plait.costs.search import batch_split, describe, search_layouts
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry

    device = measure_device(refresh=True) if calibrate else PRESETS["cpu"]  # this run's machine, measured now
    registry = default_registry()
    jobs, ranked = {}, {}
    for name, (cfg, shapes) in time_models(tiny).items():
        meta = build_meta_model(cfg, torch.float32)
        plan = plan_layout(meta, ParallelConfig(), 2, registry)
        for b, s in shapes:
            trace = trace_activations(meta, s, registry, plan.adapter, device.fused_attention_dropout)
            result = search_layouts(meta, plan.config, 2, Batch(b, s), Precision(), trace, device, registry)
            ranked[(name, b, s)] = []
            for estimate, seconds in result.ranked[:5]:
                c = estimate.plan.config
                kwargs = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "pipeline_cuts"}
                split = estimate.batch
                key = f"{name}|{split.per_device}x{s}x{split.accumulation}|{json.dumps(kwargs, sort_keys=True)}"
                jobs[key] = kwargs
                ranked[(name, b, s)].append((key, estimate, f"{describe(c)} {batch_split(split)}"))
    jobs |= calibration_jobs()
    return jobs, ranked, device


def check_invariance(device) -> list[str]:
    """The search's pick for one global batch written three ways (per device x accumulation) must be one."""
    import torch

    from plait import ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.costs.activations import trace_activations
    from plait.costs.estimate import Batch
    from plait.costs.memory import Precision
    from plait.costs.search import batch_split, describe, search_layouts
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry

    registry = default_registry()
    meta = build_meta_model(model_config(False, time_model=True), torch.float32)
    plan = plan_layout(meta, ParallelConfig(), 2, registry)
    print("\n6. the pick for one global batch, however it is written (per device x accumulation, dp=2)")
    bad = []
    for b, s in SHAPES:
        trace = trace_activations(meta, s, registry, plan.adapter)
        picks = {}
        for per_device, accumulation in ((b, 1), (b // 2, 2), (1, b)):
            best = search_layouts(meta, plan.config, 2, Batch(per_device, s, accumulation), Precision(), trace,
                                  device, registry).ranked[0][0]
            picks[f"{per_device} x {accumulation}"] = f"{describe(best.plan.config)} {batch_split(best.batch)}"
        same = len(set(picks.values())) == 1
        bad += [] if same else [f"invariance b={b} s={s}"]
        print(f"  global batch {2 * b} x {s} tokens: " + "; ".join(f"{w}: {p}" for w, p in picks.items())
              + ("  same" if same else "  DIFFERENT"))
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small sizes: checks the script runs, not the numbers")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (after 1 warm-up)")
    parser.add_argument("--no-calibrate", action="store_true", help="rank with the cpu preset instead of measuring")
    parser.add_argument("--only", choices=("bytes", "memory", "time"), help="run one part (comm and bubble come "
                        "with memory)")
    parser.add_argument("--match", default="", help="memory layouts whose name contains this only (e.g. moe)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    for name in [n for n in MEMORY_LAYOUTS if ns.match not in n]:
        del MEMORY_LAYOUTS[name]
    if ns.worker:
        worker(ns.worker[0], ns.tiny, ns.steps, ns.worker[1])
        return
    from plait.testing import launch

    wanted = {part: ns.only in (None, part) for part in ("bytes", "memory", "time")}
    jobs, ranked, device = rank_layouts(ns.tiny, not ns.no_calibrate) if wanted["time"] else ({}, {}, None)
    with tempfile.TemporaryDirectory() as tmp:
        # Two worlds: the memory parts under glibc's mmap-everything setting (RSS follows live tensors), the times
        # without it (every large allocation a system call and page faults: steps measured 1.7-2x slower under it)
        parts = {"bytes": BYTES_LAYOUTS if wanted["bytes"] else {}, "memory": MEMORY_LAYOUTS if wanted["memory"] else {}}
        per_rank = [{"bytes": {}, "memory": {}, "time": {}} for _ in range(2)]
        for world, (spec_parts, env) in enumerate(((parts, MMAP_ENV), ({"time": jobs}, {}))):
            if not any(spec_parts.values()):
                continue
            spec, out = Path(tmp) / f"jobs{world}.json", Path(tmp) / f"out{world}.json"
            spec.write_text(json.dumps({"bytes": {}, "memory": {}, "time": {}, **spec_parts}))
            argv = [__file__, "--worker", str(out), str(spec), "--steps", str(ns.steps)] + (["--tiny"] * ns.tiny)
            launch(argv, 2, timeout=3000, env=env)
            for mine, theirs in zip(per_rank, json.loads(out.read_text())):
                mine.update({part: result for part, result in theirs.items() if part in spec_parts})
    failures = report_bytes(per_rank) if wanted["bytes"] else []
    if wanted["memory"]:
        failures += report_memory(per_rank, ns.tiny) + report_comm(per_rank) + report_bubble()
    if wanted["time"]:
        failures += report_time(per_rank, ranked, device, ns.tiny)
        failures += check_invariance(device)
    print(f"\n{'all checks pass' if not failures else 'FAILED: ' + ', '.join(failures)}")


def report_bytes(per_rank) -> list[str]:
    print("1. bytes per rank: parameters / gradients / optimizer, built vs planned")
    bad = []
    for name in BYTES_LAYOUTS:
        for rank, r in enumerate(per_rank):
            m, p = r["bytes"][name]["measured"], r["bytes"][name]["predicted"]
            ok = m == p
            bad += [] if ok else [f"bytes {name} rank {rank}"]
            print(f"  {name:18} rank {rank}: built {m} planned {p} {'equal' if ok else 'MISMATCH'}")
    return bad


def report_memory(per_rank, tiny: bool) -> list[str]:
    b, s = memory_seq(tiny)
    print(f"\n2. peak over the post-load baseline (RSS high-water mark), Llama h={model_config(tiny).hidden_size} "
          f"L=4 eager attention, b={b} s={s}, fp32 (moe_: Mixtral of the same size, 8 experts, top-2)")
    print(f"  {'layout':20} {'rank':>4} {'measured MiB':>13} {'planned MiB':>12} {'of it activations':>18} {'ratio':>6}"
          f" {'saved: measured':>16} {'planned':>8}")
    bad = []
    for name in MEMORY_LAYOUTS:
        for rank, r in enumerate(per_rank):
            x = r["memory"][name]
            ratio = x["predicted"] / x["measured"] if x["measured"] > 0 else float("inf")
            ok = abs(ratio - 1) <= 0.2
            bad += [] if ok else [f"memory {name} rank {rank}"]
            # Under pp a later micro-batch reuses a freed one's addresses: saved bytes are not comparable there.
            saved = "-" if MEMORY_LAYOUTS[name].get("pp", 1) > 1 else \
                f"{x['saved'] / 2**20:16.2f} {x['saved_per_microbatch'] / 2**20:8.2f}"
            print(f"  {name:20} {rank:>4} {x['measured'] / 2**20:13.2f} {x['predicted'] / 2**20:12.2f} "
                  f"{x['activations'] / 2**20:18.2f} {ratio:6.2f} {saved:>25}{'' if ok else '  OUTSIDE 20%'}")
    return bad


def report_comm(per_rank) -> list[str]:
    import tp_comm

    from plait import ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.costs.activations import trace_activations
    from plait.costs.estimate import Batch, estimate_layout
    from plait.costs.memory import Precision
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry

    print("\n3. communication of one step: plait.base.comm's count vs planned (count, bytes), rank 0")
    # not plait.base.comm's: pipelining's send/recv, ZeroRedundancyOptimizer's broadcast, FSDP2's gathers and reduce-scatters
    unrecorded = {("pp", "send"), ("pp", "recv"), ("dp", "broadcast"), ("dp", "all_gather"), ("dp", "reduce_scatter")}
    bad = []
    for name in MEMORY_LAYOUTS:
        x = per_rank[0]["memory"][name]
        counted = {op: (sum(1 for o, _ in x["records"] if o == op), sum(n for o, n in x["records"] if o == op))
                   for op in {o for o, _ in x["records"]}}
        if "all_to_all" in counted and "ep" in MEMORY_LAYOUTS[name]:
            # ep's combine all-to-all returns what a rank computed for the others: data-dependent per rank, while
            # the planner assumes balanced routing; the mean over ranks is the balanced figure exactly
            sizes = [sum(n for o, n in r["memory"][name]["records"] if o == "all_to_all") for r in per_rank]
            counted["all_to_all"] = (counted["all_to_all"][0], sum(sizes) // len(sizes))
        planned: dict[str, list[int]] = {}
        for group, op, count, size in x["planned_comm"]:
            if (group, op) not in unrecorded:
                entry = planned.setdefault(op, [0, 0])
                entry[0], entry[1] = entry[0] + count, entry[1] + size
        planned_t = {op: tuple(v) for op, v in planned.items()}
        ok = counted == planned_t
        bad += [] if ok else [f"comm {name}"]
        print(f"  {name:18} {'equal' if ok else 'MISMATCH'}  counted {counted}  planned {planned_t}")
    registry = default_registry()
    meta = build_meta_model(tp_comm.model_config("llama"))
    for sp in (False, True):
        plan = plan_layout(meta, ParallelConfig(tp=2, sp=sp), 2, registry)
        trace = trace_activations(meta, tp_comm.S, registry, plan.adapter)
        estimate = estimate_layout(meta, plan, Batch(tp_comm.B, tp_comm.S), Precision(), trace)
        mine = {op.op: (op.count, op.bytes) for op in estimate.comm[0] if op.group == "tp"}
        formula = tp_comm.formula(sp, 2)
        # tp_comm's formula counts collectives of activations; the planner adds the grad-norm scalar (4 bytes).
        scalar = mine["all_reduce"][0] - formula["all_reduce"][0] == 1 and \
            mine["all_reduce"][1] - formula["all_reduce"][1] == 4
        same = all(mine[op] == formula[op] for op in formula if op != "all_reduce") and scalar
        bad += [] if same else [f"tp_comm formula sp={sp}"]
        print(f"  bench/tp_comm.py model sp={sp}: formula {formula} planned {mine} "
              f"{'equal (+ the grad-norm scalar)' if same else 'MISMATCH'}")
    return bad


def report_bubble() -> list[str]:
    import pp_bubble

    from plait import ParallelConfig
    from plait.costs.bubble import bubble_fraction

    print("\n4. bubble: planner vs bench/pp_bubble.py's formulas (its measured figures: run it)")
    bad = []
    for p in (2, 4):
        for m, v in pp_bubble.CONFIGS:
            config = ParallelConfig(pp=p, num_microbatches=m, virtual_pipeline_size=v,
                                    pipeline_schedule=pp_bubble.schedule_name(v))
            formula = (p - 1) / (v * m + p - 1)
            ok = abs(bubble_fraction(config) - formula) < 1e-12
            bad += [] if ok else [f"bubble p={p} m={m} v={v}"]
            print(f"  p={p} m={m} v={v}: planner {bubble_fraction(config):.3f} formula {formula:.3f}")
    return bad


def calibrated_here(per_rank, device, tiny: bool, group: str):
    """``device`` with the efficiency and per-micro-batch overhead solved from the calibration run timed in the
    turns of ``group`` ("MODEL|BxSxA": ``costs.calibration.solve_step_model``), and the two measured steps."""
    from plait.costs.calibration import Workload, run_estimates, solve_step_model

    one, several = (max(r["time"][f"{group}@{key}"] for r in per_rank) for key in calibration_jobs())
    estimates = run_estimates(Workload(calibration_config(tiny)), world=2)
    efficiency, overhead = solve_step_model(device, *estimates, one, several)
    return dataclasses.replace(device, efficiency=efficiency, microbatch_overhead=overhead), one, several


def report_time(per_rank, ranked, device, tiny: bool) -> list[str]:
    print(f"\n5. step time on this machine ({device.name}): the planner's top 5 per model and batch shape, measured;"
          f" planned on the calibration run timed in the same turns (cached calibration: efficiency "
          f"{device.efficiency:.3f}, {device.microbatch_overhead * 1e3:.2f} ms a micro-batch and layer)")
    bad = []
    for (name, b, s), rows in ranked.items():
        here, one, several = calibrated_here(per_rank, device, tiny, time_group(rows[0][0]))
        measured = [(label, max(r["time"][key] for r in per_rank), estimate) for key, estimate, label in rows]
        fastest = min(t for _, t, _ in measured)
        first = measured[0][1]
        ok = first <= 1.10 * fastest
        bad += [] if ok else [f"ranking {name} b={b} s={s}"]
        print(f"  {name}: {b} sequences x {s} tokens per rank at dp=2 (global batch {2 * b}); the calibration run "
              f"beside: {one:.3f} s as one micro-batch, {several:.3f} s as several: efficiency {here.efficiency:.3f}, "
              f"{here.microbatch_overhead * 1e3:.2f} ms")
        for label, t, estimate in measured:
            seconds, cached = estimate.step_time(here), estimate.step_time(device)
            close = abs(seconds / t - 1) <= 0.20
            bad += [] if close else [f"step time {name} b={b} s={s} {label}"]
            print(f"    planned {seconds:8.4f} s  measured {t:8.4f} s  {seconds / t:5.2f} {'ok' if close else 'OFF'}"
                  f"  (cached calibration {cached / t:5.2f})  {label}")
        print(f"    planner's first {first:.4f} s vs fastest measured {fastest:.4f} s: "
              f"{first / fastest:.2f} {'ok' if ok else 'MORE THAN 10% SLOWER'}")
    return bad


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))
    main()
