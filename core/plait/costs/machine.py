"""This machine measured as a ``Device`` (``plait plan --calibrate``; ``costs.calibration`` adds the efficiency from
a timed training run and caches the result).

On the CPU: a one-thread fp32 matmul (torchrun gives each of several local processes one thread), a copy for memory
bandwidth, the operations a CPU runs below it (``traffic.TIMED_OPS``), and gloo collectives between 2 local
processes for link bandwidth and latency. On the accelerator torch finds: its bf16 and fp32 matmuls, a copy and the
same operations, timed on it, and the memory its driver gives a program; one device has no link to time, so the links
are a preset's where the device's name is one (``device.preset_for``), else assumed (``ASSUMED_LINKS``), and said so.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from plait.base.device import describe_accelerator, synchronize, use_fused_adamw
from plait.costs.device import GPU_FRAGMENTATION, GPU_RESERVE, preset_for
from plait.costs.traffic import TIMED_OPS

CPU = torch.device("cpu")
# Links of an accelerator whose name no preset has, which one device cannot measure: a PCIe 4.0 x16 card's peer
# traffic (25 GB/s each way), 100 Gb/s between nodes, NCCL's small-message latency (tens of microseconds)
ASSUMED_LINKS = {"intra_bandwidth": 25e9, "inter_bandwidth": 12.5e9, "latency": 20e-6}


def measure_machine() -> dict:
    """This machine's CPU as ``Device`` fields, all but ``efficiency`` and its source (``costs.calibration``
    measures those from a training run)."""
    with one_thread():
        flops = _matmul_flops(CPU, torch.float32)
        copy_bw = _copy_bandwidth(CPU)
        op_bandwidth = _op_bandwidths(CPU)
    bandwidth, latency, op_speed = _gloo_allreduce()
    import psutil

    return {"name": "calibrated", "memory_bytes": psutil.virtual_memory().total, "flops_bf16": flops,
            "flops_fp32": flops, "memory_bandwidth": copy_bw, "intra_bandwidth": bandwidth,
            "inter_bandwidth": bandwidth, "per_node": os.cpu_count() or 1, "latency": latency,
            "op_speed": op_speed, "fused_adamw": use_fused_adamw(CPU),
            "fused_attention_dropout": False, "op_bandwidth": op_bandwidth}


def measure_accelerator(target: torch.device) -> tuple[dict, str]:
    """The accelerator ``target`` as ``Device`` fields, all but ``efficiency`` and its source, and where its links
    come from. Matmul peaks at the sizes a training step's reach (8192 in bf16, 4096 in fp32), a 1 GiB copy and
    ``TIMED_OPS`` on 256 MiB tensors, timed on the device; the memory its driver gives a program, less the runtime's
    reserve a preset keeps (``GPU_RESERVE``, measured on an H200); fused AdamW where torch has it. The links (and
    devices per node) are the preset's of the device's name, else ``ASSUMED_LINKS`` and the devices visible here."""
    found = describe_accelerator()
    name, memory = found if found is not None else (target.type, 0)
    preset = preset_for(name)
    if preset is not None:
        links, source = {k: getattr(preset, k) for k in (*ASSUMED_LINKS, "per_node")}, f"the {preset.name} preset's"
    else:
        links = {**ASSUMED_LINKS, "per_node": max(torch.accelerator.device_count(), 1)}
        source = "assumed (PCIe 4.0 x16, 100 Gb/s between nodes): one device has no link to time"
    fields = {"name": f"{name} (calibrated)", "memory_bytes": memory,
              "flops_bf16": _matmul_flops(target, torch.bfloat16, 8192),
              "flops_fp32": _matmul_flops(target, torch.float32, 4096),
              "memory_bandwidth": _copy_bandwidth(target, 2**28), "reserve_bytes": GPU_RESERVE,
              "fragmentation": GPU_FRAGMENTATION, "fused_adamw": use_fused_adamw(target),
              "op_bandwidth": _op_bandwidths(target, 2**26), **links}
    return fields, source


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's CPU ops on one thread, as each of several local processes torchrun starts does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seconds_on(target: torch.device, fn: Callable[[], object]) -> float:
    """Seconds ``fn``'s work takes on ``target``. On the CPU this thread's CPU time (one-thread work): what it
    costs the machine, not how long a busy machine's scheduler kept it waiting (on a shared 2-core machine a
    wall-clock matmul peak ranged 44-88 GFLOP/s). On an accelerator the wall clock from an idle queue until the
    work queued is done."""
    if target.type == "cpu":
        start = time.thread_time()
        fn()
        return time.thread_time() - start
    synchronize(target)
    start = time.perf_counter()
    fn()
    synchronize(target)
    return time.perf_counter() - start


def _matmul_flops(target: torch.device, dtype: torch.dtype, n: int = 512, repeats: int = 20) -> float:
    """The best of ``repeats`` ``n`` x ``n`` matmuls after one warm-up (a few ms each)."""
    a, b = (torch.randn(n, n, device=target, dtype=dtype) for _ in range(2))
    a @ b
    best = min(seconds_on(target, lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _copy_bandwidth(target: torch.device, numel: int = 16 * 2**20, repeats: int = 3) -> float:
    src, dst = torch.randn(numel, device=target), torch.empty(numel, device=target)
    dst.copy_(src)
    best = min(seconds_on(target, lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * numel * 4 / best  # read + write


def _op_bandwidths(target: torch.device, numel: int = 4 * 2**20) -> list[tuple[str, float]]:
    """(name, bytes per second) of every ``TIMED_OPS`` operation on ``target``, each distinct function timed once."""
    speeds: dict[Callable, float] = {}
    for fn in TIMED_OPS.values():
        if fn not in speeds:
            speeds[fn] = _op_bandwidth(fn, target, numel)
    return [(op, speeds[fn]) for op, fn in TIMED_OPS.items()]


def _op_bandwidth(fn: Callable[[torch.Tensor], torch.Tensor], target: torch.device, numel: int = 4 * 2**20,
                  repeats: int = 5) -> float:
    """Bytes ``fn`` reads and writes per second on a tensor of rows of 1024 (its input and output, as
    ``traffic.TrafficCounter`` counts them): the median of ``repeats`` after one warm-up."""
    x = torch.rand(numel // 1024, 1024, device=target) + 0.5  # positive: rsqrt's domain, a probability for bernoulli_
    fn(x)
    seconds = sorted(seconds_on(target, lambda: fn(x)) for _ in range(repeats))
    return 2 * numel * 4 / seconds[repeats // 2]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _gloo_allreduce() -> tuple[float, float, list[list]]:
    """(bytes/s of a ring all-reduce's per-rank traffic, seconds of a 4-byte all-reduce in a step (after compute),
    [[op, speed per ring byte over the all-reduce's]] for all-gather and reduce-scatter) between 2 processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the workers start in under a second where spawn's import torch and plait again (7-19 s on 2 cores);
    # they run one thread and gloo only, what a fork of a process that used OpenMP or CUDA can do, and the callers
    # (plait plan, --layout auto's launcher) hold no process group to inherit (macOS: spawn, its system frameworks
    # are not fork-safe)
    start_method = "fork" if sys.platform == "linux" else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "allreduce.json"
        mp.start_processes(_allreduce_worker, args=(port, str(out)), nprocs=2, start_method=start_method)
        result = json.loads(out.read_text())
    return result["bandwidth"], result["latency"], result["op_speed"]


def _allreduce_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    big, small = torch.ones(4 * 2**20), torch.ones(1)
    dist.all_reduce(big)
    dist.barrier()
    seconds = min(_timed(lambda: dist.all_reduce(big)) for _ in range(3))
    latency = min(_timed(lambda: dist.all_reduce(small)) for _ in range(20))
    # In a step a collective follows compute on both ranks and waits for the later one, and for gloo's transport
    # threads to be scheduled beside the busy ones: a 4-byte all-reduce after 2 ms of matmuls took 0.45 ms (median)
    # on the idle 2-core VM and 0.8-2.6 ms with other work running, against 0.16 ms back to back; cp=2's 32
    # all-to-alls a step waited 1-2 ms each (profile, docs/plan.md). The step model's latency is that median.
    work = torch.randn(256, 256)

    def after_work() -> float:
        for _ in range(5):
            work @ work
        return _timed(lambda: dist.all_reduce(small))

    in_step = statistics.median(after_work() for _ in range(30))
    half, whole = big[: big.numel() // 2], torch.empty_like(big)
    # the *_single names: torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor (wrappers of these
    # that warn), whose FutureWarning each worker printed among plait plan --calibrate's lines
    gather = min(_timed(lambda: dist.all_gather_single(whole, half)) for _ in range(3))
    scatter = min(_timed(lambda: dist.reduce_scatter_single(half, big)) for _ in range(3))
    if rank == 0:
        ring = 2 * (2 - 1) / 2 * big.numel() * 4  # what each rank sends in a ring all-reduce
        bandwidth = ring / max(seconds - latency, 1e-9)
        # each sends half the bytes of the all-reduce (all-gather: (p-1) n_local; reduce-scatter: (p-1)/p n)
        speed = [[op, ring / 2 / max(t - latency, 1e-9) / bandwidth] for op, t in
                 (("all_gather", gather), ("reduce_scatter", scatter))]
        Path(out).write_text(json.dumps({"bandwidth": bandwidth, "latency": in_step, "op_speed": speed}))
    dist.destroy_process_group()
