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

This module imports nothing from plait (a bottom layer of ``tests/test_import_graph.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

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
