"""The layout plan: everything ``parallelize`` will do, worked out once from a (meta) model and a config.

``plan_layout`` asks the adapter for its plans, checks them against the model's structure and the layout
(capabilities, pipeline schedule and cuts, tied weights across stages, tp divisibility of every sharded
module, the sequence-parallel region, activation-checkpoint targets) and returns a frozen ``LayoutPlan``. A tp
the model does not split into is refused with the tp sizes that would work for the world (the tp rules
themselves know no world; ``TPSizeError`` marks their refusals for this).
Every refusal happens here, with no process group and no weight read: a trainer calls it on a meta model
before ``init_process_group``. ``parallelize`` applies the plan; ``plait plan`` and the conformance kit
render or consume the same value, so none of them can show or accept a layout the others refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from plait.base import comm
from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import takes_images
from plait.base.pipeline_schedules import SCHEDULES
from plait.base.words import setting, setting_text
from plait.cp.dry_run import check_on_meta
from plait.cp.layout import CPPlan, plan_context_parallel
from plait.ep.layout import EPPlan, plan_expert_parallel
from plait.lora.layout import LoraPlan, plan_lora
from plait.parallel.activation_checkpoint import checkpoint_targets
from plait.parallel.deepstack import check_image_stages
from plait.parallel.float8 import plan_float8
from plait.parallel.fsdp import ROOT, edge_units, unit_of
from plait.parallel.moe_balance import check_global_scope
from plait.pipeline.cuts import StageSplit
from plait.pipeline.layout import plan_stages, replicated_across_stages, stage_rows, stages_of_rank, tied_across_stages
from plait.plugin.registry import Adapter, Registry, default_registry
from plait.tp.layout import experts_kept_whole, param_specs, plan_tensor_parallel, tp_sizes_that_fit
from plait.tp.plans import SPPlan, TPPlan
from plait.tp.sequence_parallel import sp_grad_sum_params
from plait.tp.sharding import ModuleShard, ShardSpec, TPSizeError

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig


@dataclass(frozen=True)
class LayoutPlan:
    """What every rank of a layout holds and runs, as data.

    ``config`` is resolved for the world (dp filled in). ``shards_by_rank[r]`` / ``specs_by_rank[r]``: tp rank
    r's shard decision per module and spec per parameter (names as in the unpruned model; under pp a rank
    keeps only its stages' entries; under ep, ``ep.localize`` narrows the expert parameters to an ep rank's). ``split``: the pipeline stages (None at pp=1); ``tied``: parameter names
    that are one tensor held by the first and last stage; ``replicated``: parameter names every stage holds
    (the pipeline plan's ``every_stage`` modules), their gradients summed over the pipeline. ``leaves``: modules to recompute in backward.
    ``float8``: the linear layers whose matmuls run in float8 (``plait.parallel.float8``; empty without float8).
    """

    config: ParallelConfig
    adapter: Adapter
    model_config: Any
    split: StageSplit | None
    tied: tuple[tuple[str, ...], ...]
    shards_by_rank: tuple[dict[str, ModuleShard], ...]
    specs_by_rank: tuple[dict[str, ShardSpec], ...]
    sp_plan: SPPlan | None
    leaves: tuple[str, ...]
    units: tuple[str, ...] = ()  # ZeRO-2/3: the modules that are each one FSDP2 unit (plait.parallel.fsdp): ``fsdp_units``
    lora: LoraPlan | None = None  # LoRA adapters (their specs are in specs_by_rank); the base is frozen
    cp: CPPlan | None = None  # context parallelism: the attention strategies that apply (None at cp=1)
    ep: EPPlan | None = None  # expert parallelism: the routed-experts modules (None at ep=1)
    float8: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()

    def stages_of(self, pp_rank: int) -> list[int]:
        """The pipeline stages pipeline rank ``pp_rank`` runs (empty at pp=1)."""
        return stages_of_rank(pp_rank, self.config) if self.split is not None else []


def plan_layout(
    model: nn.Module, config: ParallelConfig, world_size: int | None = None, registry: Registry | None = None,
    lora: LoraConfig | None = None,
) -> LayoutPlan:
    """The plan for laying ``model`` (a transformers causal LM, meta or real) out as ``config`` over
    ``world_size`` processes (None: the smallest world the layout needs, tp * cp * pp * (dp or 1)).

    ``lora``: train LoRA adapters (peft's config) on a frozen model instead of every parameter.
    Raises ConfigError (or AdapterError for an architecture no adapter claims), naming the values and the fix.
    """
    registry = registry or default_registry()
    adapter = registry.resolve(model.config)
    check_capabilities(adapter, config, model.config)
    check_zero_stage(config)
    check_global_scope(model, config, lora)
    ep_plan = plan_expert_parallel(model, config, world_size)
    cp_plan = plan_context_parallel(model, config)
    if cp_plan is not None:
        check_on_meta(model)
    leaf_patterns = registry.leaf_modules(adapter, model.config)
    split = None
    if config.pp > 1:
        split = plan_stages(model, config, registry.pipeline_plan(adapter, model.config), leaf_patterns)
    tied = tuple(tuple(names) for names in tied_across_stages(model, split)) if split is not None else ()
    replicated = tuple(replicated_across_stages(model, split)) if split is not None else ()
    tp_plan = registry.tp_plan(adapter, model.config) if config.tp > 1 else None
    if tp_plan is not None and not config.expert_tensor_parallel:
        tp_plan = experts_kept_whole(tp_plan)
    parallel_embeddings = not config.disable_embedding_parallelization
    world_size = world_size or config.processes
    try:
        shards_by_rank = tuple(
            plan_tensor_parallel(model, tp_plan, config.tp, r, parallel_embeddings) if tp_plan else {}
            for r in range(config.tp)
        )
    except TPSizeError as err:  # the tp rules know no world; here it is known, so say what would work in it
        hint = _tp_alternatives(model, tp_plan, config, world_size, parallel_embeddings)
        raise ConfigError(f"{err}; {hint}") from None
    sp_plan = registry.sp_plan(adapter, model.config) if config.sequence_parallel else None
    if sp_plan is not None:
        sp_grad_sum_params(model, sp_plan, shards_by_rank[0])  # validates the plan against the model
    targets = tuple(checkpoint_targets(model, leaf_patterns)) if config.gradient_checkpointing or config.fsdp else ()
    leaves = targets if config.gradient_checkpointing else ()
    units = fsdp_units(model, targets) if config.fsdp else ()
    if config.fsdp:
        check_units_share_nothing(model, units, config.zero_stage)
    lora_plan = None
    if lora is not None:
        lora_tp_plan = tp_plan
        if lora_tp_plan is None and lora.target_modules is None:  # the default targets come from the TP plan
            try:
                lora_tp_plan = registry.tp_plan(adapter, model.config)
            except ConfigError as err:  # needed for the targets only: say so, and what to give instead
                raise ConfigError(f"LoRA's default targets are the projections of the model's tp plan, which cannot "
                                  f"be had here ({err}); name the targets: "
                                  f"{setting('target_modules', ['q_proj', 'v_proj'])}") from None
        lora_plan = plan_lora(model, lora, shards_by_rank, lora_tp_plan, config.sequence_parallel)
    specs_by_rank = tuple(param_specs(model, s) | (lora_plan.specs(r) if lora_plan else {})
                          for r, s in enumerate(shards_by_rank))
    float8 = plan_float8(model, config, leaf_patterns, specs_by_rank, lora)
    return LayoutPlan(
        config=config.resolve(world_size), adapter=adapter, model_config=model.config, split=split, tied=tied,
        shards_by_rank=shards_by_rank, specs_by_rank=specs_by_rank, sp_plan=sp_plan, leaves=leaves, units=units,
        lora=lora_plan,
        cp=cp_plan, ep=ep_plan, float8=float8, replicated=replicated,
    )


def _tp_alternatives(model: nn.Module, tp_plan: TPPlan, config: ParallelConfig, world_size: int,
                     parallel_embeddings: bool) -> str:
    """What to run instead of a tp the model does not split into, for ``world_size`` processes: the tp sizes
    that fit both (divisors of world / (cp*pp) that every tp rule accepts), else pipeline stages or data
    parallelism over those processes; for a world with no room for tp > 1, the tp sizes the model allows."""
    others = config.cp * config.pp
    fixed = f" and {'cp*pp' if config.cp > 1 else 'pp'}={others}" if others > 1 else ""
    room = world_size // others if world_size % others == 0 else 1
    fits = tp_sizes_that_fit(model, tp_plan, [t for t in range(2, room + 1) if room % t == 0], parallel_embeddings)
    processes = f"{world_size} process{'es' if world_size > 1 else ''}{fixed}"
    if fits:
        return f"with {processes}, {setting_text('tp', _either(fits))} would work"
    if room > 1:
        stages = config.pp * room
        pipeline = (f"pipeline stages ({setting('pp', stages)}) or "
                    if getattr(model.config, "num_hidden_layers", 0) >= stages else "")
        return (f"with {processes}, no tp > 1 fits this model: use them for {pipeline}data parallelism "
                f"({setting('tp', 1)}: dp={room}; {setting('zero_1', True)} shards the optimizer state over it)")
    heads = getattr(model.config, "num_attention_heads", 0) or 0
    allowed = tp_sizes_that_fit(model, tp_plan, [t for t in range(2, heads + 1) if heads % t == 0],
                                parallel_embeddings)
    if not allowed:
        return "this model does not split over any tp > 1; use pipeline or data parallelism"
    return (f"this model splits over {setting_text('tp', _either(allowed))}, which {processes} cannot hold: launch "
            f"a multiple of tp*{'cp*pp' if config.cp > 1 else 'pp'} processes (--nproc_per_node)")


def _either(sizes: list[int]) -> str:
    """'2, 4 or 8'."""
    return " or ".join(filter(None, (", ".join(map(str, sizes[:-1])), str(sizes[-1]))))


def pipeline_layout(
    model: nn.Module, config: ParallelConfig, registry: Registry | None = None
) -> list[tuple[str, int | None, int]]:
    """(module name, stage, parameter bytes) of every pipeline unit of ``model`` under ``config`` (pp > 1), in
    execution order: the plan's stage split as rows for ``plait plan`` and tests."""
    plan = plan_layout(model, config, registry=registry)
    if plan.split is None:
        raise ConfigError(f"pipeline_layout needs pp > 1 (got pp={config.pp})")
    return stage_rows(model, plan.split)


def check_zero_stage(config: ParallelConfig) -> None:
    """Refuse what ZeRO-2/3 (FSDP2, ``plait.parallel.fsdp``) does not run with yet, naming the fix."""
    if not config.fsdp:
        return
    stage = f"zero_stage={config.zero_stage}"
    if config.float8 is not None:
        raise ConfigError(f"{stage} with float8={config.float8!r}: float8 weights under FSDP2 need torchao's float8 "
                          f"all-gather, which plait does not wire yet; use {setting('zero_stage', 1)} with float8")
    if config.pp > 1 and SCHEDULES[config.pipeline_schedule].split_backward:
        whole = ", ".join(repr(name) for name, s in SCHEDULES.items() if not s.split_backward)
        raise ConfigError(f"{stage} with pipeline_schedule={config.pipeline_schedule!r}: it computes weight gradients "
                          f"after FSDP2 has reduced them (after the input gradients); use one of {whole}, or "
                          f"{setting('zero_stage', 1)}")


def check_zero_has_ranks(config: ParallelConfig, given: str | None = None) -> None:
    """ZeRO shards over the dp x cp ranks of ``config`` (its world resolved): with one such rank there is nothing to
    shard over and the setting would do nothing, so it is refused, named as given (``given``, e.g. the flag the user
    typed; else as the caller writes settings). Under PLAIT_SINGLETON_GROUPS (one-rank groups that really run their
    collectives: the one-GPU tests) it runs."""
    if config.zero_stage and config.dp * config.cp == 1 and not comm.singleton_groups():
        world = config.tp * config.pp
        raise ConfigError(f"{given or setting('zero_stage', config.zero_stage)} has no effect with one data-parallel "
                          f"rank (world {world} = tp {config.tp} x pp {config.pp}): ZeRO shards over the "
                          f"data-parallel (x cp) ranks; drop it, or launch {2 * world} processes for dp=2")


def fsdp_units(model: nn.Module, leaves: tuple[str, ...]) -> tuple[str, ...]:
    """ZeRO-2/3's FSDP2 units: each leaf module (decoder layer), then the input embedding and the output head where
    they can be units of their own (``plait.parallel.fsdp.edge_units``); the model's root unit holds the rest."""
    return leaves + edge_units(model, leaves)


def check_units_share_nothing(model: nn.Module, units: tuple[str, ...], stage: int) -> None:
    """FSDP2 shards each parameter in one unit: refuse a parameter two units use (Zamba's transformer block shared
    by several layers), naming it, before torch's own error at the first forward."""
    owners: dict[int, dict[str, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = unit_of(name, units)
        unit = "the model's root" if unit == ROOT else unit
        owners.setdefault(id(param), {}).setdefault(unit, name)
    shared = next((names for names in owners.values() if len(names) > 1), None)
    if shared is not None:
        where = " and ".join(f"{unit} (as {name})" for unit, name in list(shared.items())[:2])
        raise ConfigError(f"zero_stage={stage}: one parameter is used by {where}; FSDP2 shards a parameter in one "
                          f"unit only, and a decoder layer is one unit; use {setting('zero_stage', 1)} (ZeRO-1) for this "
                          f"model")


def _capability_fix(name: str) -> str:
    """The setting that turns capability ``name`` off, in the caller's words (plait.base.words)."""
    if name == "tied_embeddings":
        return f"a model config with tie_word_embeddings false, or {setting('tp', 1)} and {setting('pp', 1)}"
    return {"tp": setting("tp", 1), "sp": setting("sp", False), "pp": setting("pp", 1),
            "vpp": setting("virtual_pipeline_size", 1)}[name]


def check_capabilities(adapter: Adapter, config: ParallelConfig, model_config: Any) -> None:
    caps = adapter.info.capabilities
    wanted = {"tp": config.tp > 1, "sp": config.sequence_parallel, "pp": config.pp > 1,
              "vpp": config.virtual_pipeline_size > 1,
              "tied_embeddings": config.tp * config.pp > 1 and bool(getattr(model_config, "tie_word_embeddings", False))}
    refused = [name for name, needed in wanted.items() if needed and not getattr(caps, name)]
    if refused:
        fixes = [_capability_fix(name) for name in refused if not (name == "sp" and "tp" in refused)]
        raise ConfigError(
            f"adapter {adapter.name!r} does not support {', '.join(refused)} (it supports: "
            f"{', '.join(caps.supported()) or 'nothing'}); change the layout ({config.describe()}): "
            f"{'; '.join(fixes)}"
        )


def check_planned_image_stages(model: nn.Module, plan: LayoutPlan) -> None:
    """Before any process group, on the meta model and the planned stages: under pp, what an image-text model's
    later stages could not get of its image inputs (``check_image_stages``; ``ParallelModel`` asks again of each
    batch, with its tensors). The trainer and ``plait generate`` ask it, so that such a layout is one line before any
    weight is read."""
    if plan.split is None or not takes_images(model.config):
        return
    first = plan.split.bounds[0][1] - plan.split.bounds[0][0]
    check_image_stages(model, plan.split.layers, first, plan.config.pp,
                       plan.config.sequence_parallel or plan.config.cp > 1)
