"""The suite's worker worlds start forked from one server that has imported torch and transformers
(plait.testing.launcher): a rank starts in well under a second instead of ~6-10 s of imports
(docs/decisions.md D8). ``PLAIT_LAUNCH=subprocess`` runs every rank as a fresh process instead.

The server imports what plait's own launcher preloads (plait.base.forking: plait's command and trainer, which every
rank running ``-m plait train`` imports next, about 1 s a rank otherwise) and, here, the conformance kit's worker
(parallelize, checkpoints, optimizers). None of them reads an environment variable at import (plait reads its own
per call), so a rank's own environment still reaches them.

Each pytest worker computes on one torch thread, as every rank of those worlds does (the launcher gives each one):
two workers already keep two cores busy, and torch's default of a thread per core in each worker made OpenMP's
threads spin against the other worker's ranks (the whole suite alone on the 2-core AMD EPYC: 866 -> 734-765 user
CPU-seconds, 597 -> 534-550 s). The processes the tests start (``plait train``, torchrun) inherit the variable; a value
set before pytest starts is kept."""

import os

from plait.base.forking import one_thread_unless_set
from plait.testing import launcher
from plait.testing.launcher import LAUNCH_ENV

os.environ.setdefault(LAUNCH_ENV, "fork")
one_thread_unless_set()
if "plait.testing.conformance_worker" not in launcher.FORK_PRELOAD:
    launcher.FORK_PRELOAD.append("plait.testing.conformance_worker")
