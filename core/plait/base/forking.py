"""Worker processes forked from a preloaded server instead of started fresh, where that is safe.

A worker of a plait run spends most of its start-up importing torch and transformers' modeling code: about 12
CPU-seconds per process on a 2-core VM, before its first line. Forked from a server that imported them once (the
standard library's multiprocessing forkserver with a preload list), a worker starts in a fraction of a second.
``plait train --nproc_per_node N`` starts torchrun's workers this way (plait.run.torchrun), and the test suite its
launched worlds (plait.testing.launcher).

Only where no accelerator is present (``forking_is_safe``): the preloaded imports touch it (torchao, which
transformers imports when installed, asks the GPU its capability), and the GPU runtimes refuse to start again in a
forked child. What a preloaded module reads from the environment at import stays as the server read it, so the
list holds modules that read no variable a worker sets for itself (plait reads its own per call), and OpenMP's
thread count, read when torch loads, is the server's: the server starts with the workers' environment.
"""

from __future__ import annotations

import os
import sys

from plait.base import device

# This module first: the hook below is registered in the server. Then what a worker imports next, heaviest first.
PRELOAD = ["plait.base.forking", "torch", "torch.distributed", "transformers", "transformers.modeling_utils",
           "plait.cli", "plait.run.trainer"]


def forking_is_safe() -> bool:
    """Whether workers may be forked from a preloaded server: no accelerator on this machine (module docstring)."""
    return device.accelerator() is None


def one_thread_unless_set() -> None:
    """torch on ``OMP_NUM_THREADS`` threads, one where it is unset (then set, for the processes this one starts):
    what torchrun gives each of several local workers. A fresh interpreter's OpenMP reads the variable when torch
    loads; a forked process has torch loaded already, with its server's count, so it sets its own here. Processes
    sharing the cores (workers of one node, the test suite's workers and its worlds' ranks) otherwise each start a
    thread per core, which spin against the others."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _reseed_numpy() -> None:
    """In a forked child: numpy's global generator drawn afresh, as in a new interpreter (Python's ``random``
    reseeds itself after a fork; numpy's does not, and every worker would share the server's)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


os.register_at_fork(after_in_child=_reseed_numpy)
