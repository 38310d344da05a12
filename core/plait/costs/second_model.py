"""The memory of a training method's second model: DPO's reference, distillation's teacher.

The method lays it out on the trained model's layout, frozen and forward-only (``plait.run.methods.frozen``): no
gradients, no optimizer state, no ZeRO sharding, no recomputation. What a rank holds for it through the step is its
parameters on that layout and, for a teacher, the logits of the micro-step it keeps for the loss (on the last
pipeline stage: the micro-step's rows x this rank's tokens x its vocabulary slice). Its forward's own activations
are freed as it goes (no autograd) and are not counted.
"""

from __future__ import annotations

import dataclasses
import math


from plait.costs.memory import rank_params
from plait.layout_plan import LayoutPlan, plan_layout
from plait.plugin.registry import Registry
from plait.run.methods.frozen import SecondModel, frozen_layout


def second_model_bytes(second: SecondModel, plan: LayoutPlan, registry: Registry, tp_rank: int, pp_rank: int,
                       rows: int, seq: int, cache: dict) -> int:
    """Bytes tp rank ``tp_rank`` of pipeline rank ``pp_rank`` holds for ``second`` while the trained model trains
    on micro-steps of ``rows`` sequences of ``seq`` tokens (the second model's plan, made on the trained model's
    layout, is kept in ``cache``)."""
    config = plan.config
    key = ("second", id(second.model), config.tp, config.cp, config.pp, config.ep, config.virtual_pipeline_size,
           config.pipeline_schedule, config.sp)
    if key not in cache:  # laid out as the run lays it out
        layout = dataclasses.replace(frozen_layout(second.model, config), dp=None)
        cache[key] = plan_layout(second.model, layout, config.processes, registry)
    held = rank_params(second.model, cache[key], tp_rank, pp_rank)
    size = next(second.model.parameters()).element_size()
    logits = 0
    if second.keeps_logits and pp_rank == config.pp - 1:
        vocab = second.model.config.get_text_config().vocab_size
        logits = rows * (seq // config.cp) * math.ceil(vocab / config.tp) * size  # in the model's dtype
    return sum(p.numel for p in held) * size + logits
