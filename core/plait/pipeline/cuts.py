"""Where the pipeline is cut: which modules each stage owns. Pure functions of a model and its plan.

They work on meta models (``plait plan``) and run before any process group exists, so a split that
cannot work is a ConfigError on every rank, never a hang. Stages own whole leaf modules (decoder layers):
the ``first`` modules of the plan go to stage 0, a contiguous run of layers to each stage, the ``last``
modules to the final stage. Parameter-free ``first``/``last`` modules (rotary tables) are recomputed by
every stage instead of being owned by one, as are the plan's ``every_stage`` modules (held by every stage).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from plait.base.config import ConfigError
from plait.base.patterns import matches
from plait.plugin.declarations import PipelinePlan


@dataclass(frozen=True)
class StageSplit:
    """The stage of every module. ``bounds[s]`` is the [start, stop) range of ``layers`` stage s owns."""

    plan: PipelinePlan
    layers: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]
    shared: tuple[str, ...]  # parameter-free first/last modules that every stage runs

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def owned_first(self) -> tuple[str, ...]:
        return tuple(name for name in self.plan.first if not self.everywhere(name))

    def owned_last(self) -> tuple[str, ...]:
        return tuple(name for name in self.plan.last if name not in self.shared)

    def modules(self, stage: int) -> list[str]:
        """The module names stage ``stage`` owns, in execution order."""
        start, stop = self.bounds[stage]
        names = list(self.owned_first()) if stage == 0 else []
        names += self.layers[start:stop]
        if stage == self.num_stages - 1:
            names += self.owned_last()
        return names

    def everywhere(self, name: str) -> bool:
        """Whether every stage runs module ``name``: parameter-free, or held by every stage (``every_stage``)."""
        return name in self.shared or name in self.plan.every_stage

    @functools.cached_property
    def _owners(self) -> dict[str, int]:
        """Module name -> the stage owning it, built once (a planner's search asks for every parameter of every
        layout)."""
        return {name: stage for stage in range(self.num_stages) for name in self.modules(stage)}

    def stage_of(self, name: str) -> int | None:
        """The stage owning module ``name`` (or None for a module every stage runs: ``everywhere``)."""
        if name in self._owners:
            return self._owners[name]
        if self.everywhere(name):
            return None
        raise KeyError(f"{name} is not a pipeline unit (first, layer or last module)")

    def stage_of_param(self, name: str) -> int | None:
        """The stage holding parameter ``name``: its nearest module that is a pipeline unit's (None where every stage
        runs that one), or the first stage for the plan's ``first_params``. KeyError: under no unit."""
        if name in self.plan.first_params:  # the first stage's own parameter of a module holding the layers
            return 0
        module = name.rpartition(".")[0]
        while module:
            if module in self._owners or self.everywhere(module):
                return self.stage_of(module)
            module = module.rpartition(".")[0]
        raise KeyError(f"parameter {name} lies under no pipeline unit (first, layer or last module)")


def fallback_plan(model: nn.Module, leaf_patterns: list[str]) -> PipelinePlan:
    """docs/decisions.md D4: the ModuleList holding the leaf modules is the repeated part; the modules
    registered before it (at every level of its path) go to the first stage, those after it to the last."""
    leaves = [name for name, _ in model.named_modules() if any(matches(p, name) for p in leaf_patterns)]
    parents = {name.rpartition(".")[0] for name in leaves}
    container = next(iter(parents)) if len(parents) == 1 else None
    if container is None or not isinstance(model.get_submodule(container), nn.ModuleList):
        raise ConfigError(
            f"cannot derive pipeline stages for {type(model).__name__}: its leaf modules {leaf_patterns} do not "
            f"select the children of one nn.ModuleList (found parents {sorted(parents) or 'none'}); give the "
            f"adapter a plait_pipeline_plan hook"
        )
    first: list[str] = []
    last: list[str] = []
    path = container.split(".")
    for depth, part in enumerate(path):
        prefix = ".".join(path[:depth])
        parent = model.get_submodule(prefix) if prefix else model
        names = list(parent._modules)
        here = names.index(part)
        qualify = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        first += [qualify(n) for n in names[:here]]
        last[:0] = [qualify(n) for n in names[here + 1 :]]
    return PipelinePlan(first=tuple(first), layers=container, last=tuple(last))


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balance(layer_costs: list[int], first_cost: int, last_cost: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges of layers, at least one per stage, minimising the most expensive stage.

    Stage 0 also pays ``first_cost`` (embeddings) and the last stage ``last_cost`` (final norm, head), so
    a large vocabulary moves layers off the end stages. Dynamic programming over (stage, layers used).
    """
    n = len(layer_costs)
    prefix = [0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, start: int, stop: int) -> int:
        extra = (first_cost if stage == 0 else 0) + (last_cost if stage == num_stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    inf = float("inf")
    # best[s][i]: the lowest achievable max cost placing the first i layers on stages 0..s-1.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    bounds, stop = [], n
    for s in range(num_stages, 0, -1):
        start = choice[s][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


def split_stages(
    model: nn.Module, plan: PipelinePlan, leaf_patterns: list[str], num_stages: int, cuts: tuple[str, ...],
    layout: str,
) -> StageSplit:
    """Cut ``model`` into ``num_stages`` stages, at ``cuts`` (a cut after each named leaf module) or balanced
    by parameter count. ``layout`` describes the config in error messages."""
    modules = dict(model.named_modules())
    for name in (plan.layers, *plan.first, *plan.last):
        if name not in modules:
            raise ConfigError(f"the pipeline plan names {name!r}, but {type(model).__name__} has no such module")
    outside = [name for name in plan.every_stage if name not in plan.first]
    if outside:
        raise ConfigError(f"the pipeline plan's every_stage modules {outside} are not among its first modules; fix the "
                          f"adapter")
    container = modules[plan.layers]
    if not isinstance(container, nn.ModuleList):
        raise ConfigError(
            f"the pipeline plan's layers {plan.layers!r} is a {type(container).__name__}, not an nn.ModuleList"
        )
    layers = tuple(f"{plan.layers}.{i}" for i in range(len(container)))
    strays = [name for name in layers if not any(matches(p, name) for p in leaf_patterns)]
    if strays:
        raise ConfigError(
            f"{strays[0]} is in the pipeline plan's layers but not a leaf module ({leaf_patterns}); fix the adapter"
        )
    if len(layers) < num_stages:
        raise ConfigError(
            f"{len(layers)} layers cannot fill {num_stages} pipeline stages ({layout}); every stage needs at least "
            f"one layer: lower pp or virtual_pipeline_size"
        )
    shared = tuple(n for n in (*plan.first, *plan.last) if param_count(modules[n]) == 0)
    if cuts:
        bounds = _bounds_from_cuts(layers, cuts, num_stages, layout)
    else:
        first_cost = sum(param_count(modules[n]) for n in plan.first if n not in plan.every_stage)  # not stage 0's
        last_cost = sum(param_count(modules[n]) for n in plan.last)
        bounds = balance([param_count(modules[n]) for n in layers], first_cost, last_cost, num_stages)
    return StageSplit(plan, layers, tuple(bounds), shared)


def _bounds_from_cuts(
    layers: tuple[str, ...], cuts: tuple[str, ...], num_stages: int, layout: str
) -> list[tuple[int, int]]:
    if len(cuts) != num_stages - 1:
        raise ConfigError(
            f"pipeline_cuts has {len(cuts)} cut(s) but {layout} needs {num_stages - 1} (one fewer than the "
            f"{num_stages} stages); name the leaf module after which each stage ends, or leave pipeline_cuts empty"
        )
    valid = layers[:-1]
    positions = []
    for cut in cuts:
        if cut not in valid:
            raise ConfigError(
                f"pipeline cut {cut!r} is not a leaf module a stage can end after; choose from "
                f"{valid[0]} ... {valid[-1]}"
            )
        positions.append(valid.index(cut) + 1)
    if positions != sorted(set(positions)):
        raise ConfigError(f"pipeline_cuts {list(cuts)} must name distinct leaf modules in model order")
    edges = [0, *positions, len(layers)]
    return list(zip(edges[:-1], edges[1:]))
