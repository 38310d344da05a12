"""Routing metrics of a mixture-of-experts model, once per optimizer step: how evenly each MoE layer's router
spreads the step's tokens over its experts, and the load-balancing loss the step trained on.

Tokens are counted where every layout agrees on what they are: a forward pre-hook on each of transformers'
experts modules (``use_experts_implementation``: ``forward(hidden_states, top_k_index, top_k_weights)``) adds up
``top_k_index``, the experts this rank's own tokens were routed to. The hook is prepended, ahead of plait's own:
under SP the experts' tensor-parallel region gathers every tp rank's tokens into the module, and the count must
see a rank's tokens once. Expert-major experts modules (Llama4's ``forward(hidden_states)``: every token once per
expert, scaled by its score) carry no routing in their arguments and are not counted.

Only training forwards count (``plait.base.training_forward``): not evaluation, not activation checkpointing's
recomputation inside backward, not the stage runs torch's pipeline schedule makes to learn tensor shapes.

At the step's end one all-reduce over the world sums the counts: replica ranks (dp x cp) route different tokens,
as do tp ranks under SP (each its sequence shard); pipeline ranks hold different layers (a layer's row is zero on
the others). Without SP the tp ranks route the same tokens, so the sum is divided by tp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.base import comm
from plait.base.training_forward import is_training_forward
from plait.ep.layout import routed_experts
from plait.parallel_model import ParallelModel


def _model_order(name: str) -> list[tuple[int, int, str]]:
    """Sort key of a module name that puts ``model.layers.10`` after ``model.layers.9``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _count(counts: torch.Tensor, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if not is_training_forward():
        return
    index = (args[1] if len(args) > 1 else kwargs["top_k_index"]).reshape(-1).long()
    counts.scatter_add_(0, index, torch.ones_like(index))


@dataclass
class StepRouting:
    """One step's routing, over the whole world. ``tokens[i]``: the tokens routed to each expert of MoE layer
    ``names[i]`` by every training forward of the step (a token counts once for each of its top-k experts, as
    routed: before a capacity drops any); ``aux_loss``: the load-balancing term the step's loss holds (``loss - aux_loss`` is the cross-entropy), None
    when the model computes none."""

    names: list[str]
    tokens: list[torch.Tensor]
    aux_loss: float | None
    dropped: int | None = None  # (token, expert) pairs dropped for capacity (expert parallelism), None: dropless

    def loads(self) -> list[float]:
        """Per layer, the busiest expert's tokens over the mean per expert: 1 is even, num_experts all on one."""
        return [(counts.max() / counts.double().mean()).item() for counts in self.tokens]

    def record(self) -> dict[str, Any]:
        """The step's metrics: the worst layer's load, every layer's (in ``names`` order), the aux loss."""
        loads = self.loads()
        record: dict[str, Any] = {"moe_load_max_over_mean": max(loads), "moe_load": [round(x, 4) for x in loads]}
        if self.aux_loss is not None:
            record["aux_loss"] = self.aux_loss
        if self.dropped is not None:
            record["moe_dropped_pairs"] = self.dropped
        return record


class RoutingMetrics:
    """Counts the tokens this rank routes to each expert of its MoE layers; ``take()`` sums them over the world
    at a step's end and starts the next step's. Build it with ``install``."""

    def __init__(self, pmodel: ParallelModel, local: list[tuple[str, nn.Module]], experts: dict[str, int]) -> None:
        self.pmodel = pmodel
        self.names = list(experts)  # every rank's MoE layers, in model order
        self.experts = list(experts.values())
        self.width = max(self.experts)
        self.rows = [self.names.index(name) for name, _ in local]
        device = next(iter(pmodel.parameters())).device
        # one bin past the experts: transformers' experts forwards take index num_experts as "no expert"
        self.counts = torch.zeros(len(local), self.width + 1, dtype=torch.int64, device=device)
        for row, (_, module) in enumerate(local):
            module.register_forward_pre_hook(functools.partial(_count, self.counts[row]), prepend=True,
                                             with_kwargs=True)

    @classmethod
    def install(cls, pmodel: ParallelModel) -> RoutingMetrics | None:
        """Count the routing of ``pmodel``'s experts modules; None when no rank holds one (a dense model).

        A collective over the world (the names of every pipeline stage's MoE layers): every rank calls it."""
        local = list(routed_experts(pmodel.module).items())
        ep = pmodel.plan.ep  # under expert parallelism a module's num_experts is its rank's share
        found = comm.all_gather_object([(name, ep.num_experts if ep else module.num_experts) for name, module in local],
                                       comm.world_group())
        experts = dict(sorted({pair for pairs in found for pair in pairs}, key=lambda pair: _model_order(pair[0])))
        return cls(pmodel, local, experts) if experts else None

    def take(self) -> StepRouting:
        """The routing since the last call, summed over the world; resets it, and ``pmodel.aux_loss_sum``.

        A collective over the world: every rank calls it at the same point of the step."""
        world, mesh = comm.world_group(), self.pmodel.mesh
        total = torch.zeros(len(self.names) * self.width + 3, dtype=torch.float64, device=comm.device_for(world))
        tokens = total[:-3].view(len(self.names), self.width)
        total[-3] = self.pmodel.experts.take_dropped()
        tokens[self.rows] = self.counts[:, :self.width].to(total)
        aux = self.pmodel.aux_loss_sum
        if aux is not None:
            total[-2:] = torch.stack([aux.to(total), torch.ones_like(total[-1])])
        comm.all_reduce(total, world)
        self.counts.zero_()
        self.pmodel.aux_loss_sum = None
        copies = 1 if mesh.config.sequence_parallel else mesh.tp  # tp ranks routing the same tokens
        per_layer = [(tokens[i, :n] / copies).long() for i, n in enumerate(self.experts)]
        # every tp rank holds the same aux loss (computed from the whole forward's router logits)
        aux_loss = (total[-2] / mesh.tp).item() if total[-1] else None
        capacity = mesh.config.moe_capacity_factor is not None
        # each tp rank dispatches the same pairs (under SP, all of the tp group's)
        dropped = int(total[-3].item()) // mesh.tp if capacity else None
        return StepRouting(self.names, per_layer, aux_loss, dropped)
