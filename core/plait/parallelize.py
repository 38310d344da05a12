"""``parallelize(model, config)``: the one entry point, applying a layout plan in a fixed order.

config -> ``plan_layout`` (adapter, plans, every refusal; no communication) -> mesh (process groups) ->
rank 0's weights on every rank (a model that holds them: plait.parallel.replicas) -> pipeline pruning (drop other
stages' modules) -> tensor parallel layers -> float8 -> sequence parallel region -> activation checkpointing ->
gradient sync -> pipeline runner -> ``ParallelModel`` (plait.parallel_model). Data flows one way: each step is built
from the ones before it and handed to the next, and nothing is patched in afterwards.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.base.config import ConfigError, ParallelConfig
from plait.base.mesh import Mesh
from plait.base.meta import before_language_model, takes_images
from plait.cp.attention import install_context_parallel
from plait.cp.context import ContextParallel
from plait.cp.router import install_router_gather
from plait.ep.apply import AppliedEP, apply_expert_parallel
from plait.layout_plan import LayoutPlan, check_zero_has_ranks, plan_layout
from plait.lora.layers import LoraDropout, apply_lora
from plait.parallel.activation_checkpoint import apply_activation_checkpointing
from plait.parallel.float8 import apply_float8, check_float8_device
from plait.parallel.fsdp import apply_fsdp, remap_params
from plait.parallel.grad_sync import GradSync, norm_params
from plait.parallel.moe_balance import aux_divisor, global_balance
from plait.parallel.replicas import broadcast_from_first
from plait.parallel_model import ParallelModel, local_specs, precision_context
from plait.pipeline.runner import PipelineRunner
from plait.pipeline.stages import StageChunk, dropped, prune
from plait.plugin.registry import Registry
from plait.tp.apply import AppliedTP, apply_tensor_parallel
from plait.tp.loss import CausalLMLoss
from plait.tp.rng import install_dropout_rng
from plait.tp.sequence_parallel import install_sequence_parallel, region_prefix, sp_grad_sum_params
from plait.tp.sharding import ModuleShard, ShardSpec
from plait.tp.styles import Row

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig


def check_world_started(config: ParallelConfig) -> None:
    """Refuse, saying how to start one, a layout of several processes where no torch.distributed world runs:
    the script was started without torchrun, or under torchrun without joining its process group. The latter for
    any layout: a data-parallel one (``ParallelConfig()``, ZeRO) would otherwise run as that many separate
    one-process trainings, each on the whole batch, writing the same files."""
    needed = config.processes
    layout = f"the layout ({config.describe()}) needs {needed} processes" if needed > 1 else \
        f"the layout ({config.describe()}) spans the world torchrun started"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"{layout}, and this process is one of torchrun's {os.environ['WORLD_SIZE']} but has not "
                          f"joined their group; call torch.distributed.init_process_group() before parallelize")
    if needed == 1:
        return
    script = Path(sys.argv[0]).name or "your_script.py"
    raise ConfigError(f"{layout}, but this process runs alone (no torchrun, no process group); launch it as "
                      f"`torchrun --nproc_per_node {needed} {script}` and call torch.distributed.init_process_group() "
                      f"before parallelize")


def parallelize(
    model: nn.Module, config: ParallelConfig | LayoutPlan, *, registry: Registry | None = None,
    timeout: datetime.timedelta | None = None, lora: LoraConfig | None = None, lora_seed: int = 0,
) -> ParallelModel:
    """Lay ``model`` (a transformers causal LM, on CPU, GPU or meta) out over the running world.

    ``config``: the layout, or a ``LayoutPlan`` already computed for this model (``plan_layout``).
    ``lora``: freeze the model and train LoRA adapters (peft's config; ``plait.lora``), initialised from
    ``lora_seed`` when the model holds weights (a meta model gets them from ``materialize``).
    A model that holds weights is made global rank 0's on every rank first (``plait.parallel.replicas``): ranks
    that built it with different seeds would otherwise train replicas that never agree.
    ``timeout`` bounds every collective on the tp/pp/dp groups (see ``Mesh.from_world``). Every check that
    can fail runs before the first collective, so a bad layout is an error on every rank, never a hang.
    """
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        check_world_started(config.config if isinstance(config, LayoutPlan) else config)
    world_size = dist.get_world_size() if distributed else 1
    if isinstance(config, LayoutPlan):
        plan = config
        plan.config.resolve(world_size)  # a plan made for another world size: raises, naming the numbers
    else:
        plan = plan_layout(model, config, world_size, registry, lora)
    check_zero_has_ranks(plan.config)
    if plan.float8:  # a model that holds weights already: float8 needs a GPU for it, unless emulated
        check_float8_device(plan.config, next(model.parameters()).device)
    return _apply(model, plan, Mesh.from_world(plan.config, timeout), lora_seed)


def _apply(model: nn.Module, plan: LayoutPlan, mesh: Mesh, lora_seed: int = 0) -> ParallelModel:
    config = plan.config
    broadcast_from_first(model, comm.world_group())  # the replicas start equal: one model is laid out
    stage_ids = plan.stages_of(mesh.pp_rank)
    if plan.split is not None:
        prune(model, plan.split, stage_ids)  # before anything touches weights: other stages' modules are gone
    owns = lambda name: not dropped(model, name)  # noqa: E731
    shards = {name: shard for name, shard in plan.shards_by_rank[mesh.tp_rank].items() if owns(name)}
    applied = apply_tensor_parallel(model, shards, mesh, config.sequence_parallel, before_language_model(model))
    apply_float8(model, [name for name in plan.float8 if owns(name)], config)  # before any hook lands on a linear
    experts = apply_expert_parallel(model, plan.ep, mesh, owns) if plan.ep is not None else AppliedEP()
    cp = None
    if plan.cp is not None:
        cp = ContextParallel(mesh.cp_group, mesh.cp_rank, plan.cp, install_context_parallel(model))
        if getattr(model.config, "output_router_logits", False):
            install_router_gather(model, mesh.cp_group)  # every cp rank computes the whole aux loss
    sp_params: list[nn.Parameter] = []
    if plan.sp_plan is not None:
        sp_params = sp_grad_sum_params(model, plan.sp_plan, shards)
        install_sequence_parallel(model, plan.sp_plan, mesh.tp_group, applied.head_is_parallel, owns)
    if plan.lora is not None:  # after the SP region is checked: LoRA's own sums are in lora/layout.py
        sums, expert_factors = apply_lora(model, plan.lora, mesh, config.sequence_parallel, owns, lora_seed, plan.ep)
        applied.grad_sums += sums
        experts.params += expert_factors  # their gradients, too, are summed over the expert-replica group
    if config.tp > 1:
        rng = install_dropout_rng(model, mesh.tp_rank, *_dropout_regions(model, plan, shards, owns))
        for module in model.modules():
            if isinstance(module, LoraDropout):
                module.rng = rng
    apply_activation_checkpointing(model, [name for name in plan.leaves if owns(name)], applied.entry.clear)
    fsdp = None
    if config.fsdp and not comm.trivial(mesh.replica_group):  # last: it replaces every parameter
        before = dict(model.named_parameters(remove_duplicate=False))
        expert_modules = [name for name in plan.ep.modules if owns(name)] if plan.ep is not None else []
        fsdp = apply_fsdp(model, [name for name in plan.units if owns(name)], mesh.replica_group, config.zero_stage,
                          config.mixed_precision, expert_modules, mesh.expert_replica_group)
        new = remap_params(before, model)
        sp_params = [new[id(p)] for p in sp_params]
        applied.grad_sums = [(new[id(p)], group, part) for p, group, part in applied.grad_sums]
    grad_sync = _grad_sync(model, plan, mesh, applied, sp_params, experts.params, local_specs(model, plan, mesh, fsdp))
    grad_sync.sometimes_unused = takes_images(model.config)
    loss_fn = _loss_fn(applied, mesh, shift=cp is None)
    balance = global_balance(model, config, mesh.dp_group)
    pipeline = None
    if plan.split is not None:
        seq_shards = config.tp if config.sequence_parallel else 1
        context = functools.partial(precision_context, config, model)
        term = balance.term if balance is not None else None
        chunks = [StageChunk(model, plan.split, s, seq_shards, applied.entry.clear, context, cp, term)
                  for s in stage_ids]
        pipeline = PipelineRunner(chunks, stage_ids, mesh, loss_fn, plan.split.plan.token_ids, aux_divisor(config))
    return ParallelModel(model, mesh, plan, applied, grad_sync, loss_fn, pipeline, cp, experts, fsdp, balance)


def _dropout_regions(
    model: nn.Module, plan: LayoutPlan, shards: dict[str, ModuleShard], owns: Callable[[str], bool]
) -> tuple[list[str], list[str]]:
    """Modules whose dropout must differ between tp ranks, and the row-parallel layers after which it must
    not (see tp/rng.py): under SP every decoder layer of the region; without SP every attention block, with
    its output projection handing back to the shared stream."""
    if plan.sp_plan is not None:
        container = region_prefix(plan.sp_plan.begin).rstrip(".")
        layers = [f"{container}.{child}" for child, _ in model.get_submodule(container).named_children()]
        return [name for name in layers if owns(name)], []
    attention = sorted({shard.owner for shard in shards.values() if shard.entered_by_parent})
    rows = [name for name, shard in shards.items() if isinstance(shard.style, Row)]
    return attention, rows


def _grad_sync(
    model: nn.Module, plan: LayoutPlan, mesh: Mesh, applied: AppliedTP, sp_params: list[nn.Parameter],
    experts: list[nn.Parameter], specs: dict[str, ShardSpec],
) -> GradSync:
    local = dict(model.named_parameters(remove_duplicate=False))
    names = {id(p): name for name, p in local.items()}
    held = lambda part, name: part.in_rows(*specs[name].rows) if specs[name].rows else part  # noqa: E731 (ZeRO-2/3)
    shared: dict[Any, list[nn.Parameter]] = defaultdict(list)
    for param in sp_params:
        if param.requires_grad:  # frozen (LoRA's base) parameters have no gradient to sum
            shared[mesh.tp_group].append(param)
    shared_parts = {}
    for param, group, part in applied.grad_sums:
        if param.requires_grad:
            shared[group].append(param)
            if part is not None:
                shared_parts[id(param)] = held(part, names[id(param)])
    tied = list({id(p): p for names in plan.tied for n in names
                 if (p := local.get(n)) is not None and p.requires_grad}.values())
    replicated = list({id(p): p for n in plan.replicated
                       if (p := local.get(n)) is not None and p.requires_grad}.values())
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    copies = tied + replicated  # counted in the norm on the first stage only
    counted, partly = norm_params(trained, list(plan.specs_by_rank), mesh.tp_rank,
                                  skip=copies if mesh.pp_rank > 0 else ())
    trainable = [p for p in model.parameters() if p.requires_grad]
    # A collective: every rank creates the group, in the same order, even a middle stage holding no copy.
    ends_group = mesh.pipeline_ends_group() if plan.tied else None
    return GradSync(mesh, trainable, dict(shared), tied, ends_group, counted,
                    [p for p in experts if p.requires_grad], replicated, shared_parts,
                    {id(local[name]): held(part, name) for name, part in partly.items()})


def _loss_fn(applied: AppliedTP, mesh: Mesh, shift: bool = True) -> CausalLMLoss:
    """The causal-LM loss of this rank's logits (vocab-parallel when the head is split over tp); ``shift``:
    False when the labels come already shifted (context parallelism)."""
    return CausalLMLoss(applied.vocab_start, mesh.tp_group if applied.head_is_parallel else None, shift,
                        applied.vocab_size)