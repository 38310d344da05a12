"""The pipeline layout of a model under a config: validated before any collective, printable by ``plait plan``.

``plan_stages`` is what ``plan_layout`` (``plait.layout_plan``) calls before any process group exists;
``stage_rows`` shows a split as a table for humans (it also works on a meta model). This package knows
nothing of adapters: it takes their pipeline plan and leaf patterns as values.
"""

from __future__ import annotations

from collections import defaultdict
from torch import nn

from plait.base.config import ConfigError, ParallelConfig
from plait.pipeline.cuts import StageSplit, fallback_plan, split_stages
from plait.pipeline.router import router_aux
from plait.pipeline.runner import check_schedule
from plait.plugin.declarations import PipelinePlan


def plan_stages(
    model: nn.Module, config: ParallelConfig, plan: PipelinePlan | None, leaf_patterns: list[str]
) -> StageSplit:
    """The stage split for ``config`` (pp * virtual_pipeline_size stages), or a ConfigError naming the fix.

    ``plan``: the adapter's pipeline plan (None: derived from the ModuleList holding the leaf modules). A model
    whose router aux loss the last stage cannot compute as one process does is refused here (``router_aux``)."""
    router_aux(model)
    num_stages = config.pp * config.virtual_pipeline_size
    layout = f"pp*virtual_pipeline_size = {config.pp}*{config.virtual_pipeline_size}"
    check_schedule(config)
    plan = plan or fallback_plan(model, leaf_patterns)
    split = split_stages(model, plan, leaf_patterns, num_stages, config.pipeline_cuts, layout)
    tied_across_stages(model, split)
    return split


def tied_across_stages(model: nn.Module, split: StageSplit) -> list[list[str]]:
    """Parameter names that are one tensor held by different stages (tied embeddings), per tensor.

    Only the first and last stage may share one: their gradients are summed over the pipeline ends. A tensor
    of a module every stage holds (``replicated_across_stages``) is summed over the whole pipeline instead.
    """
    replicated = set(replicated_across_stages(model, split))
    tied = []
    for names in _tensors(model).values():
        if replicated.intersection(names):
            continue
        stages = {_stage_of_param(split, name) for name in names}
        if len(stages) < 2:
            continue
        if stages != {0, split.num_stages - 1}:
            raise ConfigError(
                f"parameters {names} are one tensor shared by pipeline stages {sorted(stages)}; plait syncs tied "
                f"weights only between the first and last stage (embedding and LM head)"
            )
        tied.append(names)
    return tied


def replicated_across_stages(model: nn.Module, split: StageSplit) -> list[str]:
    """The names of every parameter that every stage holds: those of the plan's ``every_stage`` modules (and
    the other names of the same tensors, a tied LM head). Each stage's forward gives them the gradient of its
    own layers, so their gradients are summed over the pipeline (``GradSync``) and every copy takes the same step.
    """
    every = split.plan.every_stage
    held = [names for names in _tensors(model).values()
            if any(_module_of(name, every) is not None for name in names)]
    return [name for names in held for name in names]


def _tensors(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter name of ``model``, by tensor (a tied weight has several)."""
    places: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        places[id(param)].append(name)
    return places


def _module_of(param_name: str, modules: tuple[str, ...]) -> str | None:
    """The one of ``modules`` holding parameter ``param_name``, if any."""
    return next((m for m in modules if param_name.startswith(f"{m}.")), None)


def _stage_of_param(split: StageSplit, param_name: str) -> int:
    try:
        stage = split.stage_of_param(param_name)
    except KeyError:
        raise ConfigError(
            f"parameter {param_name} lies outside every pipeline unit (first, layers, last) of the plan; the "
            f"adapter's pipeline plan does not cover this model"
        ) from None
    if stage is None:
        raise ConfigError(f"{param_name} belongs to a module the pipeline plan treats as parameter-free")
    return stage


def stage_rows(model: nn.Module, split: StageSplit) -> list[tuple[str, int | None, int]]:
    """(module name, stage, parameter bytes) of every pipeline unit, in execution order, for ``plait plan``.

    ``stage`` is None for modules every stage runs: parameter-free ones it recomputes (rotary tables), and the
    plan's ``every_stage`` modules, which every stage holds (Gemma's per-layer embeddings). Bytes are of the
    full (unsharded) parameters at their current dtype; tensor parallelism divides most of them by tp. A
    tied weight is counted on both stages that hold a copy. Works on a meta model; needs no process group.
    """
    rows: list[tuple[str, int | None, int]] = []
    for name in (*split.plan.first, *split.layers, *split.plan.last):
        module = model.get_submodule(name)
        size = sum(p.numel() * p.element_size() for p in module.parameters())
        rows.append((name, split.stage_of(name), size))
    return rows


def stage_bytes(rows: list[tuple[str, int | None, int]]) -> dict[int, int]:
    """Parameter bytes per stage from ``stage_rows``; a module of every stage's (``stage`` None) counts on each."""
    stages = sorted({stage for _, stage, _ in rows if stage is not None})
    total: dict[int, int] = defaultdict(int)
    for _, stage, size in rows:
        for held in stages if stage is None else (stage,):
            total[held] += size
    return dict(total)


def rank_of_stage(stage: int, pp: int) -> int:
    """Looped placement: stage s runs on pipeline rank s % pp (rank r holds stages r, r + pp, ...)."""
    return stage % pp


def stages_of_rank(pp_rank: int, config: ParallelConfig) -> list[int]:
    return [pp_rank + chunk * config.pp for chunk in range(config.virtual_pipeline_size)]
