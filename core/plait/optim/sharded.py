"""The optimizer of a ZeRO-2/3 model (``plait.parallel.fsdp``): any torch optimizer, stepping each parameter's local rows.

FSDP2's parameters are DTensors whose local rows are this rank's 1/dp of each tp/pp shard. Stepping those rows as
plain tensors (views of FSDP2's own storage, so the next gather sees the update) keeps the optimizer state plain
tensors of the same rows: a checkpoint saves them, like the parameters, as boxes of the logical tensors
(``ShardSpec.rows``), so any layout reads them back. With ``mixed_precision`` the rows are fp32 and are the
master weights: the optimizer state is fp32 and nothing else is copied.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.optim.stand_ins import StandInOptimizer
from plait.parallel.fsdp import local


class ShardedOptimizer(StandInOptimizer):
    """Runs ``optimizer_class`` on the local rows of the (DTensor) parameters it is given; ``param_groups`` and
    ``state`` are the inner optimizer's, keyed by the rows."""

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], **defaults: Any) -> None:
        super().__init__(params, optimizer_class, lambda p: local(p).detach(), **defaults)
