"""The suite's worker worlds start forked from one server that has imported torch and transformers
(plait.testing.launcher): a rank starts in well under a second instead of ~6-10 s of imports
(docs/decisions.md D8). ``PLAIT_LAUNCH=subprocess`` runs every rank as a fresh process instead."""

import os

from plait.testing.launcher import LAUNCH_ENV

os.environ.setdefault(LAUNCH_ENV, "fork")
