"""The one module that knows device types; everything else in plait asks it.

plait must run wherever torch does: CPU with gloo, CUDA with NCCL, and equally XPU, XLA or an out-of-tree
PrivateUse1 backend (a torch-native Trainium backend, say). So no other library module names a device type:
the device comes from torch's accelerator API (``torch.accelerator``), the backend from torch.distributed's own
device-to-backend table, the fused-optimizer question from torch's own list. A backend torch learns about by
registering itself is then served without a line here (``torch.distributed.Backend.register_backend`` with
``devices=`` is what ``default_backend`` then answers). ``tests/test_device_agnostic.py`` fails on a mention
of cuda outside a comment anywhere else in ``core/``, ``adapters/``, ``scripts/`` and ``examples/``.

This module imports nothing from plait (it is the bottom layer of ``tests/test_import_graph.py``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def accelerator() -> torch.device | None:
    """The accelerator torch finds on this machine (a device type, no index), or None where there is none."""
    return torch.accelerator.current_accelerator(check_available=True)


def describe_accelerator() -> tuple[str, int] | None:
    """The accelerator torch finds: its model name (lower case) and the memory its driver gives a program, or None
    on a machine without one (``plait train --layout auto`` picks a device model by them)."""
    found = accelerator()
    if found is None:
        return None
    module = torch.get_device_module(found.type)
    if not hasattr(module, "get_device_name") or not hasattr(module, "get_device_properties"):
        return None
    return module.get_device_name(found).lower(), module.get_device_properties(found).total_memory


def pick_device(name: str) -> torch.device:
    """``--device`` as a ``torch.device``.

    ``auto`` is the accelerator torch finds, else the CPU. A bare name of torch's accelerator type gets this
    process's ``LOCAL_RANK`` as its index (torchrun starts one process per device); any other name, with or
    without an index, is taken as written (``cpu``, ``xla``, a PrivateUse1 backend's name, ``cuda:3``).
    """
    if name == "auto":
        found = accelerator()
        name = found.type if found is not None else "cpu"
    device = torch.device(name)
    built_for = torch.accelerator.current_accelerator()  # the build's accelerator type, found or not
    if device.index is None and built_for is not None and device.type == built_for.type:
        return torch.device(device.type, int(os.environ.get("LOCAL_RANK", 0)))
    return device


def default_backend(device: torch.device) -> str:
    """torch.distributed's default backend for ``device``'s type, from torch's own table (gloo on cpu; a
    backend registered with ``devices=`` adds its own); ValueError saying to name one where torch has none."""
    try:
        return dist.get_default_backend_for_device(device)
    except ValueError as err:
        raise ValueError(f"torch.distributed has no default backend for device type {device.type!r}; name one "
                         f"with --backend") from err


def set_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator device (where collectives and new tensors go); a
    no-op for the CPU and for device types torch's accelerator API does not manage (e.g. XLA)."""
    if _managed(device) and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def current_device() -> torch.device:
    """This process's current accelerator device (the one ``set_device`` chose), else the CPU."""
    found = accelerator()
    return torch.device(found.type, torch.accelerator.current_device_index()) if found else torch.device("cpu")


def use_fused_adamw(device: torch.device) -> bool:
    """Whether to ask AdamW for its fused kernel (one launch for all parameters) on ``device``: on the
    accelerator types torch lists as having it, never on the CPU (its per-tensor path is kept there) nor in
    the PrivateUse1 slot, which torch lists whatever the backend behind it implements."""
    unsure = {"cpu", torch._C._get_privateuse1_backend_name()}
    return device.type in set(_get_fused_kernels_supported_devices()) - unsure


def _managed(device: torch.device) -> bool:
    found = accelerator()
    return found is not None and device.type == found.type


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``; nothing to wait for on the CPU (nor for types torch's accelerator
    API does not manage)."""
    if _managed(device):
        torch.accelerator.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory torch's allocator has held on ``device`` since the last ``reset_peak_memory``; None on
    the CPU (the trainer reports the process's peak resident memory instead) and for unmanaged types."""
    return torch.accelerator.max_memory_allocated(device) if _managed(device) else None


def reset_peak_memory(device: torch.device) -> None:
    """Start ``peak_memory_bytes`` afresh on ``device`` (a no-op where it gives None)."""
    if _managed(device):
        torch.accelerator.reset_peak_memory_stats(device)


FLOAT8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0)


def float8_unsupported(device: torch.device) -> str | None:
    """Why ``device`` cannot run float8 matmuls (``torch._scaled_mm``, what torchao's float8 training calls), or
    None where it can: CUDA GPUs of compute capability 8.9 or more. The meta device is answered None (a model laid
    out there is checked again when its weights arrive)."""
    major, minor = FLOAT8_CAPABILITY
    gpus = f"CUDA GPUs of compute capability {major}.{minor} or more (L4, L40S, RTX 4090, H100, H200, B200)"
    if device.type == "meta":
        return None
    if device.type != "cuda":
        return f"float8 matmuls (torch._scaled_mm) run on {gpus}; this run is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}, and "
                f"float8 matmuls (torch._scaled_mm) run on {gpus}")
    return None

