"""Apply an EP plan to one rank's model: keep this rank's experts and route tokens to the others'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from plait.base.mesh import Mesh
from plait.ep.dispatch import ExpertMajorParallel, ExpertParallel
from plait.ep.layout import EPPlan


@dataclass
class AppliedEP:
    """What applying EP left behind: the expert parameters (their gradients are summed over
    ``mesh.expert_replica_group``, not the replica group) and each module's dispatch (its dropped-pair count)."""

    params: list[nn.Parameter] = field(default_factory=list)
    dispatches: list[ExpertParallel] = field(default_factory=list)

    def take_dropped(self) -> int:
        """(token, expert) pairs this rank dropped for capacity since the last call."""
        dropped = sum(d.dropped for d in self.dispatches)
        for d in self.dispatches:
            d.dropped = 0
        return dropped


def apply_expert_parallel(model: nn.Module, plan: EPPlan, mesh: Mesh, owns: Callable[[str], bool]) -> AppliedEP:
    """Narrow every routed-experts module this rank holds (``owns``: not pruned by the pipeline) to ep rank
    ``mesh.ep_rank``'s experts and install the dispatch."""
    start, stop = plan.expert_range(mesh.ep_rank)
    applied = AppliedEP()
    for name in plan.modules:
        if not owns(name):
            continue
        module, rows = model.get_submodule(name), plan.rows_per_expert(name)
        for param in module.parameters():  # its own (transformers' experts) or its children's (DBRX's mlp)
            # in place: the same Parameter objects stay in the tp rules' gradient sums (experts kept whole)
            param.data = param.data[start * rows:stop * rows].clone()
            applied.params.append(param)
        dispatch = (ExpertMajorParallel if plan.expert_major else ExpertParallel)(
            mesh.ep_group, plan.num_experts, plan.capacity_factor)
        dispatch.install(module)
        applied.dispatches.append(dispatch)
    return applied
