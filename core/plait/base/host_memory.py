"""glibc's malloc told to keep the memory a CPU training step frees, for the next step to reuse.

By default glibc hands a freed block above its mmap threshold (dynamic, from 128 KiB up to 32 MiB) back to the OS
and trims the top of its heap, so a step on the CPU page-faults its activations and gradients in again, every
step, and more of them the larger its micro-batches: on the 2-core VM (bench/cpu_malloc.py) steps of 1024- and
2048-token micro-batches took 0.76-0.89 of their time with the memory kept (512-token ones 0.99-1.00), and by
default one 1024-token micro-batch ran 4-11% slower than the same tokens as two, which no step-time model of
FLOPs, bytes and a per-micro-batch overhead holds. torch's CPU allocator keeps no cache of its
own, so plait asks the C library, once per training process on the CPU: blocks up to 1 GiB come from the heap,
and the heap is not trimmed. The process's resident memory then stays at its peak between steps, which a
training process reaches every step anyway.

What a step frees and allocates again in a different pattern does not fit that rule: ZeRO-2/3 (FSDP2) gathers a
unit, frees it and reduce-scatters its gradient, unit after unit, in blocks of a unit's size, while small objects
(autograd nodes, tensors' bookkeeping) are allocated between them. In the kept heap those small objects land in
the holes the big blocks leave and pin them, so the next gather cannot reuse the hole and the heap grows: measured
with a malloc interposer, a 90M-parameter Llama at dp=2 held at most 0.85-1.2 GiB live per rank but its heap grew
to 2.0-2.8 GiB under ZeRO-3 (1.4-1.5 GiB under ZeRO-1), step after step, and the same with glibc's own defaults.
``mapped_empty`` gives such buffers pages of their own, outside the heap, returned to the OS when freed.

This module imports nothing from plait (a bottom layer of ``tests/test_import_graph.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform

import torch

# mallopt's parameters (malloc.h) and the values plait sets: mallopt takes an int
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 2**30, 2**31 - 1


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory for reuse (above); whether it applied: False on a C library other than
    glibc (macOS, musl), where nothing is changed."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                         TRIM_THRESHOLD))


def mapped_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor in pages mapped for it alone (an anonymous ``mmap``): not in malloc's heap,
    so freeing it leaves no hole there, and its pages go back to the OS when the last view of it is freed (the
    tensor holds the mapping). For large short-lived buffers allocated in a pattern that fragments the heap."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel)
