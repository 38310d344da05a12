"""The suite's worker worlds start forked from one server that has imported torch and transformers
(plait.testing.launcher): a rank starts in well under a second instead of ~6-10 s of imports
(docs/decisions.md D8). ``PLAIT_LAUNCH=subprocess`` runs every rank as a fresh process instead.

The server also imports what most of the suite's ranks import next: plait (every forked rank imports it anyway, to
unpickle its target), its trainer (``-m plait train``: peft, rich) and the conformance kit's worker (parallelize,
checkpoints, optimizers), about 1 s a rank otherwise (a world of 2 running ``plait train``: 1.2-1.4 s against
2.4-3.2 s). None of them reads an environment variable at import (plait reads its own per call), so a rank's own
environment still reaches them."""

import os

from plait.testing import launcher
from plait.testing.launcher import LAUNCH_ENV

os.environ.setdefault(LAUNCH_ENV, "fork")
launcher.FORK_PRELOAD += [m for m in ("plait", "plait.cli", "plait.run.trainer", "plait.testing.conformance_worker")
                          if m not in launcher.FORK_PRELOAD]
