"""The MoE router's load-balancing loss under context parallelism, as one process computes it.

transformers' auxiliary loss is a product of two averages over every token of the forward (the fraction of
tokens routed to each expert and the mean routing probability), so per-slice losses do not add up to it.
Each cp rank therefore hands transformers all ranks' router logits: the router modules transformers records
(``_can_record_outputs["router_logits"]``, e.g. ``MixtralTopKRouter``) get a forward hook that all-gathers
their logits over the cp group, routing itself staying local. Every rank then computes the whole forward's aux
loss; ``ParallelModel`` adds 1/C of it on each, and the gather's backward sums the ranks' gradients before
each keeps its own tokens' (the adjoint of the gather), so value and gradient are one process's. The tokens
come rank by rank: the loss sums over them, so their order matters only with a padding mask, which
``ParallelModel`` refuses beside the router loss under cp.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.tp.layers import RouterLogitsGather


def router_recorders(model: nn.Module) -> list[tuple[type, int]]:
    """(router module class, index of the logits in its output) that transformers records for the aux loss."""
    found = []
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if target is not None and (target, recorder.index) not in found:
            found.append((target, recorder.index))
    return found


def install_router_gather(model: nn.Module, group: Any) -> int:
    """Gather the recorded router logits of ``model`` over ``group`` (cp); returns how many routers."""
    recorders = router_recorders(model)
    count = 0
    for module in model.modules():
        for target, index in recorders:
            if isinstance(module, target):
                RouterLogitsGather(group, grad_is_partial=True, index=index).install(module)
                count += 1
    return count
