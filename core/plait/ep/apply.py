"""Apply an EP plan to one rank's model: keep this rank's experts and route tokens to the others'."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from plait.ep.dispatch import ExpertParallel
from plait.ep.layout import EPPlan
from plait.mesh import Mesh


def apply_expert_parallel(model: nn.Module, plan: EPPlan, mesh: Mesh, owns: Callable[[str], bool]) -> list[nn.Parameter]:
    """Narrow every routed-experts module this rank holds (``owns``: not pruned by the pipeline) to ep rank
    ``mesh.ep_rank``'s experts and install the dispatch; returns their parameters, whose gradients are summed
    over ``mesh.expert_replica_group`` rather than the replica group."""
    start, stop = plan.expert_range(mesh.ep_rank)
    params: list[nn.Parameter] = []
    for name in plan.modules:
        if not owns(name):
            continue
        module = model.get_submodule(name)
        for leaf, old in list(module.named_parameters(recurse=False)):
            new = nn.Parameter(old.detach()[start:stop].clone(), requires_grad=old.requires_grad)
            module._parameters[leaf] = new
            params.append(new)
        ExpertParallel(mesh.ep_group, plan.num_experts, plan.capacity_factor).install(module)
    return params
