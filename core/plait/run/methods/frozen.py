"""A frozen second model on the trained model's mesh: DPO's reference, distillation's teacher.

It is laid out with the trained model's layout (the same tp, cp, pp and dp ranks, so its logits for a micro-batch are
on the ranks that compute the loss, sliced the same way), forward-only: no ZeRO sharding of optimizer state it does
not have, no activation checkpointing for a backward it never runs. Its weights are read lazily into its shards as
the trained model's are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import datetime
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.base import comm
from plait.base.config import ConfigError, ParallelConfig
from plait.base.images import ImageBatch
from plait.base.meta import build_meta_model
from plait.checkpoint.materialize import materialize_source, resolve_source
from plait.ep.layout import own_experts, routed_experts
from plait.layout_plan import plan_layout
from plait.parallel_model import ParallelModel
from plait.parallelize import parallelize
from plait.tp.logprobs import Logits


@dataclass(frozen=True)
class SecondModel:
    """What ``plait plan`` counts of a method's frozen second model: ``model`` on the meta device, in its dtype;
    ``role`` names it in the plan's notes; ``keeps_logits``: its logits of a micro-step are kept for the loss."""

    model: nn.Module
    role: str
    keeps_logits: bool = False


def check_vocabulary(flag: str, source: str, role: str, trained: str, model_config: Any) -> None:
    """Refuse a second model whose vocabulary is not the trained model's, from its config alone (before any
    process group): its log-probs would be of other tokens."""
    other = resolve_source(source)[0]
    if other.vocab_size != model_config.vocab_size:
        raise ConfigError(f"{flag} {source} has vocab_size {other.vocab_size}, the {trained} "
                          f"{model_config.vocab_size}; the {role} must share the {trained}'s tokenizer")


def frozen_layout(model: nn.Module, trained: ParallelConfig) -> ParallelConfig:
    """The layout of a frozen second model beside a model trained with ``trained``: the same tp, cp, pp and dp ranks,
    forward-only (no ZeRO, no recomputation), and the trained ep only where ``model`` has routed experts to divide (a
    dense teacher of an MoE student holds its layers whole on every rank of the ep group). ``plait plan`` counts it
    with the same layout (``plait.costs.second_model``)."""
    ep = trained.ep if routed_experts(model) or own_experts(model) else 1
    return dataclasses.replace(trained, zero_stage=0, zero_1=False, mixed_precision=False,
                               gradient_checkpointing=False, ep=ep)


def read_rows(model: ParallelModel, ids: torch.Tensor, labels: torch.Tensor, read: Callable[[Logits], torch.Tensor],
              position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
              images: ImageBatch | None = None) -> torch.Tensor | None:
    """``read`` of each row of a batch under ``model`` (a function of its logits: per-row log-probs, the logits
    themselves), forward-only and in eval mode (the model's mode restored after), [rows, ...]; None on the ranks that
    compute no loss (every pipeline stage but the last). ``attention_mask``: for rows with left padding (GRPO's);
    ``images``: an image-text model's, of these rows."""
    kept: dict[str, torch.Tensor] = {}

    def keep(logits: Logits) -> torch.Tensor:
        value = read(logits).detach()
        out = kept.setdefault("out", value.new_empty((ids.shape[0], *value.shape[1:])))
        out[logits.rows] = value  # by row: torch's pipeline schedules may run a micro-batch's loss twice
        return logits.values.new_zeros((), dtype=torch.float32)

    training = model.training
    model.eval()
    try:
        model.eval_loss(ids, labels, attention_mask, position_ids=position_ids, objective=keep, images=images)
    finally:
        model.train(training)
    return kept.get("out")


def frozen_on_mesh(source: Any, args: Any, trained: ParallelModel, device: torch.device) -> ParallelModel:
    """The model at ``source`` (a model directory, a plait checkpoint or a config for the seeded init, as
    ``resolve_source`` reads it) on ``trained``'s layout, frozen, in ``trained``'s dtype."""
    meta = build_meta_model(resolve_source(source)[0], torch.bfloat16 if args.bf16 else torch.float32)
    plan = plan_layout(meta, frozen_layout(meta, trained.config), comm.group_size(comm.world_group()))
    model = parallelize(meta, plan, timeout=datetime.timedelta(seconds=args.ddp_timeout))
    materialize_source(model, source, seed=args.seed, device=device)
    model.requires_grad_(False)
    return model
