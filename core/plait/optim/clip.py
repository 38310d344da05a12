"""Gradient clipping by the global norm: the norm of the whole model's gradient, whatever the layout.

Each rank adds the squares of the gradient slices it is responsible for (``ParallelModel.grad_norm_params``
counts every distinct tp slice once; under ZeRO-1 each dp rank counts only the parameters it owns, the
only ones whose reduced gradient it has), then the sums are added over the tp, pp and (ZeRO) dp groups.
The clipping rule is torch's ``clip_grad_norm_``: scale by ``max_norm / (norm + 1e-6)`` when below 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.parallel.grad_sync import grads_of
from plait.tp.sharding import Part


def global_grad_norm(
    params: Iterable[nn.Parameter], groups: Sequence[dist.ProcessGroup | None], device: torch.device,
    dtype: torch.dtype = torch.float32, experts: Iterable[nn.Parameter] = (), ep_group: dist.ProcessGroup | None = None,
    parts: dict[int, Part] | None = None,
) -> torch.Tensor:
    """The L2 norm (in ``dtype``, on ``device``) of the gradients of ``params`` with squares summed over ``groups``.

    ``experts``: gradients of expert-parallel parameters, which the other ranks of ``ep_group`` hold other experts
    of: their squares are summed over ``ep_group`` first (under ZeRO-1 pass them in ``params`` instead: each
    expert slice then has one owner in the replica group, which ``groups`` already sums over).

    ``dtype`` must be the same on every rank (the all-reduces sum one tensor of it): fp32 for fp32, bf16 or fp16
    gradients, float64 for a float64 model. A rank with nothing to count (a ZeRO rank owning no counted
    parameter) still joins the all-reduces. ``parts``: of some parameters (by id) this rank counts only a part.
    """
    total = _squares(params, device, dtype, parts)
    experts = list(experts)
    if experts:
        total = total + comm.all_reduce(_squares(experts, device, dtype), ep_group)
    for group in groups:
        comm.all_reduce(total, group)
    return total.sqrt()


def _squares(params: Iterable[nn.Parameter], device: torch.device, dtype: torch.dtype,
             parts: dict[int, Part] | None = None) -> torch.Tensor:
    """The sum of squares of the gradients of ``params`` (of ``parts`` where given): per-tensor norms from one
    multi-tensor kernel per (device, dtype) group (``torch._foreach_norm``, what ``clip_grad_norm_`` uses), not one
    launch per tensor."""
    norms = [norm for grads in _by_dtype(grads_of(params, parts)).values()
             for norm in torch._foreach_norm(grads, 2, dtype=dtype)]
    return torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=dtype, device=device)


def _by_dtype(grads: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


@torch.no_grad()
def clip_grads_(params: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale the gradients of ``params`` so that the global norm ``total_norm`` becomes at most ``max_norm``."""
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for (_, dtype), grads in _by_dtype(grads_of(params)).items():
        torch._foreach_mul_(grads, scale.to(dtype))
