"""Model FLOPs utilisation as torchtitan reports it, shared by the GPU benchmarks (bench/gpu.py, bench/titan.py)
so that every row of their tables is divided by the same peak and counts the same FLOPs. Imports nothing, so
that bench/titan.py can use it in torchtitan's environment."""

from __future__ import annotations

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}  # dense bf16 FLOP/s, datasheet


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the device named ``device_name`` (None when unknown, e.g. a CPU)."""
    return next((value for key, value in PEAK_BF16.items() if key in device_name), None)


def flops_per_token(matmul_params: int, layers: int, hidden: int, seq: int) -> float:
    """6 N + 12 L h s: N the parameters of the matmuls (a tied embedding once, as the LM head; an untied input
    embedding not at all), and attention's score and value products over a sequence of ``seq`` tokens."""
    return 6 * matmul_params + 12 * layers * hidden * seq
