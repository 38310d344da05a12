"""``plait.base.host_memory``: glibc keeps the memory a CPU step frees (issue 30: the page faults behind CPU steps that
ran faster split). Each case runs in a fresh interpreter: mallopt changes its whole process, and glibc's
thresholds start from their defaults only in a new one."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

FREED = """
import json, sys, torch
from plait.base.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "kept" else False
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
before = rss()
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written: resident
held = rss()
del block
print(json.dumps({"applied": applied, "held": held - before, "after": rss() - before}))
"""


def freed(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FREED, setting], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_block_stays_for_reuse_where_glibc_is_told_and_goes_back_to_the_os_where_not():
    """By default a freed 64 MiB tensor (above glibc's mmap threshold) leaves the resident set at once, to be
    page-faulted in again by the next step; after ``keep_freed_memory`` it stays in the heap."""
    default, kept = freed("default"), freed("kept")
    assert default["held"] >= 60 * 2**20 and default["after"] < 8 * 2**20
    assert kept["applied"] and kept["held"] >= 60 * 2**20 and kept["after"] >= 60 * 2**20


MAPPED = """
import json, torch
from plait.base.host_memory import keep_freed_memory, mapped_empty
keep_freed_memory()
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
before = rss()
block = mapped_empty(64 * 2**20 // 4, torch.float32).view(2**10, -1)
block.fill_(1.0)
held = rss()
rows = block[:4]  # a view keeps the mapping
del block
kept = rss()
total = float(rows.sum())
del rows
print(json.dumps({"held": held - before, "kept": kept - before, "after": rss() - before, "sum": total}))
"""


def test_a_mapped_buffer_goes_back_to_the_os_when_freed_even_where_glibc_keeps_the_heap():
    """``mapped_empty`` (FSDP2's gather and reduce-scatter buffers on the CPU) lives outside the kept heap: its pages
    are resident while any view of it is, and leave the resident set when the last one is freed."""
    out = subprocess.run([sys.executable, "-c", MAPPED], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] >= 60 * 2**20 and r["kept"] >= 60 * 2**20 and r["after"] < 8 * 2**20
    assert r["sum"] == 4 * 2**14
