"""Whole tensors from a laid-out model: for comparing it with one process (tests, the conformance kit) and for
exporting what a running model trained (``plait.checkpoint.lora_export.gather_lora``).

Training never needs these: each rank works on its shards. They all-gather over the tp group, so every tp
rank must call them together.
"""

from __future__ import annotations

import torch

from plait.base import comm
from plait.parallel.fsdp import local as rows
from plait.parallel_model import ParallelModel


def gather_full(pmodel: ParallelModel, name: str, local: torch.Tensor) -> torch.Tensor:
    """The full logical tensor of parameter ``name`` (or of its gradient) from every tp rank's shard (and, for
    a tensor stacked over experts under expert parallelism, every ep rank's experts; under ZeRO-3 every dp rank's
    rows)."""
    spec, mesh, plan = pmodel.param_specs[name], pmodel.mesh, pmodel.plan
    local = rows(local).detach()
    if spec.rows is not None:  # ZeRO-3: this rank's rows of its tp shard first
        local = pmodel.fsdp.gather_rows(name, local, spec)
    pieces, tp_ranks = local.unsqueeze(0), [mesh.tp_rank]  # [tp ranks, *local]
    if spec.dim is not None:
        pieces, tp_ranks = comm.all_gather(pieces, mesh.tp_group, dim=0), range(mesh.tp)
    pieces, ep_ranks = pieces.unsqueeze(0), [None]  # [ep ranks, tp ranks, *local]
    if spec.experts is not None:
        pieces, ep_ranks = comm.all_gather(pieces, mesh.ep_group, dim=0), range(plan.ep.size)
    full = local.new_zeros(spec.full_shape)
    for ep_rank, row in zip(ep_ranks, pieces):
        for tp_rank, piece in zip(tp_ranks, row):
            shard = plan.specs_by_rank[tp_rank][name]
            if ep_rank is not None:
                shard = plan.ep.localize({name: shard}, ep_rank)[name]
            shard.place(piece, full)
    return full
