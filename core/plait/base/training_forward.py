"""Whether the forward running now is one of a step's training forwards, for anything that counts per step.

Not one: evaluation (``no_grad``); activation checkpointing's second run of a layer inside backward (the autograd
engine then has a graph task running: ``torch._C._current_graph_task_id() != -1``); torch's pipeline schedule
running each stage once more when it is built, only to learn its tensor shapes
(``PipelineStage._forward_metadata_inference`` on the stack; tests/test_moe_metrics.py's pp2 case fails if torch
renames it).
"""

from __future__ import annotations

import sys

import torch


def is_training_forward() -> bool:
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_forward_metadata_inference":
            return False
        frame = frame.f_back
    return True
