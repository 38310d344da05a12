"""TP's part of the layout plan: tp rank r's shard decision for every module a TP plan names, and the spec of
every parameter. Pure functions of a (meta) model, no communication.

``plan_layout`` calls them before any process group exists; each rule decides its own modules
(``tp/styles/``), in the shard types of ``tp/sharding.py``.
"""

from __future__ import annotations

from torch import nn

from plait.base.config import ConfigError
from plait.base.patterns import matches
from plait.tp.plans import TPPlan
from plait.tp.sharding import ModuleShard, ShardSpec
from plait.tp.styles import MoEExperts, WholeExperts


def plan_tensor_parallel(
    model: nn.Module, plan: TPPlan, tp: int, rank: int, parallel_embeddings: bool = True
) -> dict[str, ModuleShard]:
    """Shard decisions of tp rank ``rank`` for every module the plan names (works on meta models).

    Raises ConfigError, naming the values, for sizes that do not divide, and for a plan rule that matches
    no module of the model (a plan written for another model version).
    """
    modules = dict(model.named_modules())
    shards: dict[str, ModuleShard] = {}
    for rule in plan.rules:
        hits = [name for name in modules if matches(rule.pattern, name)]
        if not hits:
            raise ConfigError(
                f"the TP plan names {rule.pattern!r}, but the model ({type(model).__name__}) has no such module; "
                f"the adapter does not fit this model"
            )
        if rule.vocab_parallel and not parallel_embeddings:
            continue
        for name in hits:
            for shard in rule.shards(name, modules[name], tp, rank):
                shards[shard.name] = shard
    return shards


def tp_sizes_that_fit(model: nn.Module, plan: TPPlan, sizes: list[int], parallel_embeddings: bool = True) -> list[int]:
    """Those of ``sizes`` that every module the plan names splits into: the heads, kv heads and features rules
    of every rule, checked as ``plan_tensor_parallel`` checks them (on rank 0: they do not depend on the rank)."""
    fits = []
    for tp in sizes:
        try:
            plan_tensor_parallel(model, plan, tp, 0, parallel_embeddings)
        except ConfigError:
            continue
        fits.append(tp)
    return fits


def param_specs(model: nn.Module, shards: dict[str, ModuleShard]) -> dict[str, ShardSpec]:
    """Spec of every parameter name of ``model`` (replicated unless a shard decision says otherwise)."""
    specs = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        shard = shards.get(module_name)
        spec = shard.spec(leaf) if shard is not None else None
        specs[name] = spec if spec is not None else ShardSpec(tuple(param.shape))
    return specs


def experts_kept_whole(plan: TPPlan) -> TPPlan:
    """``plan`` with its routed experts (``MoEExperts``) kept whole on every tp rank (``WholeExperts``):
    ``ParallelConfig(expert_tensor_parallel=False)``."""
    return TPPlan(tuple(WholeExperts(rule.pattern) if type(rule) is MoEExperts else rule for rule in plan.rules))
