"""The training methods ``plait train --method`` chooses from, by name (``TrainArgs.method`` lists the same names:
the flags are read without importing the methods)."""

from __future__ import annotations

from typing import Any

from plait.base.config import ConfigError
from plait.data.sft_records import data_format
from plait.run.methods.base import TrainingMethod
from plait.run.methods.dpo import DPO
from plait.run.methods.grpo import GRPO
from plait.run.methods.kd import Distillation
from plait.run.methods.next_token import NextToken
from plait.run.methods.reference_free import CPO, ORPO
from plait.run.methods.vision_sft import VisionSFT

METHODS: dict[str, type[TrainingMethod]] = {"next_token": NextToken, "dpo": DPO, "cpo": CPO, "orpo": ORPO,
                                            "kd": Distillation, "grpo": GRPO}


def method_for(args: Any) -> type[TrainingMethod]:
    """The method --method names; next-token training on image-text rows (--data_format vision, or auto on a first
    .jsonl line with ``images``) is an image-text-to-text model's SFT (``VisionSFT``)."""
    if args.method == "next_token" and args.train_file:
        try:
            vision = data_format(args.sft_source()) == "vision"
        except (ValueError, ConfigError):  # a bad file: the data loading's own check says so, in its words
            vision = False
        if vision:
            return VisionSFT
    return METHODS[args.method]
