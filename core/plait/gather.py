"""Whole tensors from a laid-out model: for comparing it with one process (tests, the conformance kit) and for
exporting what a running model trained (``plait.lora.export.gather_lora``).

Training never needs these: each rank works on its shards. They all-gather over the tp group, so every tp
rank must call them together.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.parallelize import ParallelModel


def gather_full(pmodel: ParallelModel, name: str, local: torch.Tensor) -> torch.Tensor:
    """The full logical tensor of parameter ``name`` (or of its gradient) from every tp rank's shard (and, for
    an expert parameter under expert parallelism, every ep rank's experts)."""
    spec = pmodel.param_specs[name]
    if spec.dim is None:
        held = local.detach().clone()
    else:
        pieces = comm.all_gather(local.detach().unsqueeze(0), pmodel.mesh.tp_group, dim=0)
        shape = spec.full_shape if spec.experts is None else (spec.local_shape[0], *spec.full_shape[1:])
        held = local.new_zeros(shape)  # the full tensor, or under ep this rank's experts, each whole
        for rank, piece in enumerate(pieces):  # tp splits inside each expert (never dim 0)
            pmodel.plan.specs_by_rank[rank][name].place(piece, held)
    if spec.experts is None:
        return held
    return comm.all_gather(held.contiguous(), pmodel.mesh.ep_group, dim=0)  # ep ranks hold consecutive experts


def gather_logits(pmodel: ParallelModel, local_logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from every tp rank's slice; padding never shows."""
    applied = pmodel.applied
    if not applied.head_is_parallel:
        return local_logits
    padded = torch.nn.functional.pad(local_logits, (0, applied.vocab_per_rank - local_logits.shape[-1]))
    # Real vocab rows are contiguous from 0 across ranks and padding sits at the end, so concatenating the
    # padded slices and cutting at the vocab size gives the full logits.
    return comm.all_gather(padded, pmodel.mesh.tp_group, dim=-1)[..., : applied.vocab_size]
