"""Process start-up: which device and backend, and the torch.distributed world torchrun describes.

Nothing here assumes CUDA: the device type and backend come from flags (``auto`` picks cuda + nccl when a
GPU is present, else cpu + gloo), so an XLA device and backend can be named instead.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def pick_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(device)


def init_distributed(device: torch.device, backend: str, timeout_s: int) -> bool:
    """Join the world torchrun started (WORLD_SIZE > 1); return whether it is distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
