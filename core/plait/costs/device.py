"""A small device model for step-time estimates: peak FLOP/s, memory and link bandwidths, per preset.

The presets are vendor figures (docs/plan.md lists the sources); ``efficiency`` is the fraction of peak FLOP/s a
transformer step's matmuls reach: measured for the H100 and H200 by bench/gpu.py and bench/gpu_headroom.py (below),
assumed elsewhere (Megatron-LM and torchtitan report 40-55% MFU on H100/A100 with fused kernels).
``costs.machine`` measures this machine instead (its CPU, or the accelerator torch finds), and ``costs.calibration``
adds the efficiency, from a timed training run, and caches the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from plait.base.config import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU process) and its links. Bandwidths in bytes/s one way; latency in seconds."""

    name: str
    memory_bytes: int
    flops_bf16: float
    flops_fp32: float
    efficiency: float
    memory_bandwidth: float
    intra_bandwidth: float  # within a node (NVLink, NeuronLink, loopback)
    inter_bandwidth: float  # between nodes (InfiniBand, EFA)
    per_node: int
    latency: float
    # What the runtime takes beside the model's tensors: the CUDA (or Neuron) context and the communication
    # library's buffers, a fixed amount, plus the allocator's fragmentation, a fraction of the memory.
    reserve_bytes: int = 0
    fragmentation: float = 0.0
    # A collective's speed per ring byte over the all-reduce's, where the library runs it slower: gloo's
    # all-gather and reduce-scatter (ZeRO-2/3's) on loopback, measured by ``calibrate``; NCCL runs them alike (1).
    op_speed: tuple[tuple[str, float], ...] = ()
    # AdamW's fused kernel (one pass over each tensor; plait asks for it where torch has one: GPUs), or torch's
    # multi-tensor AdamW, which reads and writes the state about ten times a step (the CPU)
    fused_adamw: bool = True
    # Where ``efficiency`` comes from, said beside every step time printed with it
    efficiency_source: str = "assumed"
    # Seconds each micro-batch costs per decoder layer (forward and backward) beyond its FLOPs and memory traffic:
    # the framework's per-operation dispatch and small matmuls running below the peak. Measured by ``calibrate``
    # (on this CPU 3-12 ms a layer, on an H200 1.1-1.3 ms); about 1 ms on Hopper GPUs (``HOPPER_MICROBATCH``).
    microbatch_overhead: float = 0.0
    # The fused attention kernel takes dropout (flash and memory-efficient attention on GPUs); torch's CPU kernel
    # does not, so sdpa with attention dropout runs its math path there, s x s probabilities and all
    fused_attention_dropout: bool = True
    # Bytes read and written per second by the operations ``traffic.TIMED_OPS`` names, where they run below the
    # memory bandwidth (a CPU's random numbers and transcendental functions): measured by ``measure_machine``
    op_bandwidth: tuple[tuple[str, float], ...] = ()
    # Where the ranks of a node share one memory (a CPU's processes, the host's RAM): the node's, of which
    # ``memory_bytes`` is each rank's share, its ``per_node``-th (``calibration``); 0 where each device has its own
    host_memory: int = 0

    def speed(self, op: str) -> float:
        return dict(self.op_speed).get(op, 1.0)

    def bandwidth(self, op: str) -> float:
        """Bytes per second operation ``op`` (an aten name, or ``traffic.PLAIN``) reads and writes."""
        return dict(self.op_bandwidth).get(op, self.memory_bandwidth)

    def flops(self, low_precision: bool) -> float:
        return (self.flops_bf16 if low_precision else self.flops_fp32) * self.efficiency

    def peak_flops(self, low_precision: bool) -> float:
        """The vendor's peak, the denominator of MFU."""
        return self.flops_bf16 if low_precision else self.flops_fp32

    @property
    def reserved(self) -> int:
        return self.reserve_bytes + int(self.fragmentation * self.memory_bytes)

    @property
    def shares_host(self) -> bool:
        """``memory_bytes`` is this rank's share of ``host_memory``, said beside the fit so that it is not read as the
        whole host's (a figure given in its place, ``plait plan --device_memory``, is the rank's own)."""
        return self.host_memory > 0 and self.per_node > 1 and self.memory_bytes == self.host_memory // self.per_node

    @property
    def usable_bytes(self) -> int:
        """What a layout's tensors may take: the memory a program gets, less the reserve."""
        return self.memory_bytes - self.reserved

    def describe_efficiency(self) -> str:
        return f"efficiency {self.efficiency:.3g} of peak for matmuls ({self.efficiency_source})"

    def describe_memory(self) -> str:
        memory = f"{self.memory_bytes / GiB:.2f} GiB"
        if self.shares_host:
            memory = f"{self.host_memory / GiB:.2f} GiB shared by {self.per_node} ranks: {memory} each,"
        return (f"{self.usable_bytes / GiB:.2f} GiB usable per device ({memory} less {self.reserved / GiB:.2f} GiB "
                f"kept for the runtime's context, communication buffers and fragmentation)")


# The memory of a preset is what the driver gives a program; the reserve is what the runtime takes of it beside the
# tensors the planner traces, measured by bench/gpu_headroom.py on an H200 (bench/results/gpu-headroom-h200-*.jsonl;
# docs/plan.md, "Headroom"): the CUDA context and the kernels and library handles it loads, 0.75 GiB after a step;
# NCCL's buffers, 0.54 GiB at one rank (one GPU cannot hold two), with 1 GiB kept for the per-peer buffers of 8
# ranks; and the caching allocator's fragmentation (its reserved over its allocated peak): 0.55-3.6 GiB, at most
# 4.5% of an 80 GB card's memory (8 sequences of 2048 tokens with recomputation), taken as 5%.
GPU_RESERVE, GPU_FRAGMENTATION = int(1.75 * GiB), 0.05
# Each micro-batch beyond the first costs the Hopper GPUs 0.6-2.4 ms per decoder layer beyond its FLOPs (the 1.24B
# Llama's 2 to 8 sequences of 2048 tokens timed as one micro-batch and as several; median 1.0 ms, bench/gpu_headroom.py)
HOPPER_MICROBATCH = 1e-3
# A CPU process's: torch's CPU allocator caches nothing, so the interpreter and libraries' own memory is the reserve
CPU_RESERVE = GiB // 2
PRESETS = {
    # H100 SXM5: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 80 GB HBM3 (the driver gives a program 79.1 GiB) at
    # 3.35 TB/s, NVLink 4 900 GB/s (450 GB/s each way), 8 per node, ConnectX-7 400 Gb/s per GPU.
    # Efficiency measured (bench/gpu.py, bench/results/gpu-h100-2026-11-25.jsonl): plait --bf16, eager, the 1.24B
    # Llama at 4 x 2048 tokens took 0.196 and 0.201 s a step on an H100 80GB HBM3; at 0.60, with the H200's
    # per-micro-batch cost and every non-matmul operation's bytes (``traffic``), the planner predicts 0.198 s.
    "h100": Device("h100", int(79.1 * GiB), 989e12, 67e12, 0.60, 3.35e12, 450e9, 50e9, 8, 10e-6, GPU_RESERVE,
                   GPU_FRAGMENTATION, efficiency_source="measured by bench/gpu.py",
                   microbatch_overhead=HOPPER_MICROBATCH),
    # H200 SXM: the H100's compute, 141 GB HBM3e (the driver gives a program 139.8 GiB) at 4.8 TB/s, NVLink 4, 8
    # per node, 400 Gb/s per GPU. Efficiency measured (bench/gpu_headroom.py): the same step took 0.177-0.178 s;
    # at 0.60 (the H100's: the traffic at each one's bandwidth tells them apart) the planner predicts 0.177 s, and
    # splits of 2-8 sequences into 1-8 micro-batches, with and without recomputation, within -16%..+10%.
    "h200": Device("h200", int(139.8 * GiB), 989e12, 67e12, 0.60, 4.8e12, 450e9, 50e9, 8, 10e-6, GPU_RESERVE,
                   GPU_FRAGMENTATION, efficiency_source="measured by bench/gpu_headroom.py",
                   microbatch_overhead=HOPPER_MICROBATCH),
    # A100 SXM4 80GB: 312 TFLOP/s dense bf16, 19.5 TFLOP/s fp32, 2.0 TB/s HBM2e (79.1 GiB to a program), NVLink 3
    # 600 GB/s (300 each way), 8 per node, 200 Gb/s HDR InfiniBand per GPU.
    # Efficiency and per-micro-batch cost not measured on an A100: the H100's.
    "a100": Device("a100", int(79.1 * GiB), 312e12, 19.5e12, 0.60, 2.0e12, 300e9, 25e9, 8, 10e-6, GPU_RESERVE,
                   GPU_FRAGMENTATION, efficiency_source="assumed: the H100's, measured by bench/gpu.py",
                   microbatch_overhead=HOPPER_MICROBATCH),
    # Trainium1 chip (trn1.32xlarge / 16): 190 TFLOP/s bf16, 47.5 TFLOP/s fp32, 32 GiB HBM at 820 GB/s,
    # NeuronLink-v2 768 GB/s per instance ring (~384 GB/s each way per chip), EFA 800 Gb/s per instance.
    "trn1": Device("trn1", 32 * GiB, 190e12, 47.5e12, 0.4, 820e9, 384e9 / 2, 100e9 / 16, 16, 20e-6, GiB,
                   GPU_FRAGMENTATION),
    # Trainium2 chip (trn2.48xlarge / 16): 667 TFLOP/s dense bf16, 181 TFLOP/s fp32, 96 GiB HBM at 2.9 TB/s,
    # NeuronLink-v3 1 TB/s per chip, EFA 3.2 Tb/s per instance.
    "trn2": Device("trn2", 96 * GiB, 667e12, 181e12, 0.4, 2.9e12, 500e9, 400e9 / 16, 16, 20e-6, GiB,
                   GPU_FRAGMENTATION),
    # A generic CPU process (one core, gloo over loopback): placeholders; prefer --calibrate.
    "cpu": Device("cpu", 16 * GiB, 50e9, 50e9, 1.0, 10e9, 2e9, 1e9, 1, 100e-6, CPU_RESERVE, 0.0, fused_adamw=False,
                  efficiency_source="a placeholder: --calibrate measures this machine", fused_attention_dropout=False),
}


def preset_for(name: str) -> Device | None:
    """The preset of an accelerator by the name its driver reports ("NVIDIA H100 80GB HBM3" -> h100), or None."""
    name = name.lower()
    return next((device for key, device in PRESETS.items() if key in ("h100", "h200", "a100") and key in name), None)


_UNITS = {"": 2**30, "g": 2**30, "gib": 2**30, "gb": 10**9, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_memory(text: str, flag: str = "--device_memory") -> int:
    """Bytes from a size as users write it: "80GB" (10^9), "78GiB", "512MiB", "80G" (GiB, as nvidia-smi), or a bare
    number of GiB ("78")."""
    match = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{flag}={text!r} is not a size; give GiB as a number (78) or with a unit (80GB, 78GiB, "
                          f"512MiB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{flag}={text!r} must be positive")
    return value
