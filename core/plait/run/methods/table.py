"""The training methods ``plait train --method`` chooses from, by name (``TrainArgs.method`` lists the same names:
the flags are read without importing the methods)."""

from __future__ import annotations

from plait.run.methods.base import TrainingMethod
from plait.run.methods.dpo import DPO
from plait.run.methods.grpo import GRPO
from plait.run.methods.kd import Distillation
from plait.run.methods.next_token import NextToken
from plait.run.methods.reference_free import CPO, ORPO

METHODS: dict[str, type[TrainingMethod]] = {"next_token": NextToken, "dpo": DPO, "cpo": CPO, "orpo": ORPO,
                                            "kd": Distillation, "grpo": GRPO}
