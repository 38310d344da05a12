"""``plait plan --search``: every layout of a world, estimated, refused with a reason or ranked by step time.

The global batch (sequences per optimizer step: per-device batch x dp x accumulation as the user wrote them, or
``--global_batch_size``) is kept, and how it is split is searched with the layout: for each dp, every micro-batch
size b that divides the global batch's share of a data-parallel rank, with the accumulation steps that make up
the rest, so the pick does not depend on how the user wrote the batch (8 per device, or 1 x 8 accumulation).
Enumerated: tp, cp and pp dividing the world (cp with the strategy asked for, ``auto`` by default), virtual
stages from 1 up to as many as the layers allow (powers of two; interleaved 1f1b and zero-bubble above 1),
micro-batches from pp up to b (powers of two times pp that divide it), ep dividing dp x cp and every MoE layer's
experts (1 for a dense model), SP on/off at tp > 1, ZeRO-1 on/off at dp x cp > 1, activation checkpointing
on/off. A layout whose block size the cp split cannot cut (2 cp, or 2 cp tp under SP, must divide it), that the
adapter or the pipeline refuses (``plan_layout``'s ConfigError, cp's own refusals included), or whose peak
exceeds the device's usable memory, is listed with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from plait.base.config import ConfigError, ParallelConfig
from plait.base.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULES
from plait.costs.activations import ActivationTrace
from plait.costs.device import Device
from plait.costs.estimate import Batch, LayoutEstimate, estimate_layout
from plait.costs.second_model import SecondModel
from plait.costs.experts import divided_experts
from plait.costs.memory import Precision
from plait.cp.sequence import check_length
from plait.layout_plan import LayoutPlan, check_units_share_nothing, fsdp_units, plan_layout
from plait.plugin.registry import AdapterError, Registry

if TYPE_CHECKING:
    from peft import LoraConfig


@dataclass
class SearchResult:
    """Layouts that fit, fastest first, with their estimated seconds per step; refusals as (layout, reason)."""

    ranked: list[tuple[LayoutEstimate, float]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def search_layouts(
    model: nn.Module, base: ParallelConfig, world_size: int, batch: Batch, precision: Precision,
    trace: ActivationTrace, device: Device, registry: Registry, weight_decay: float = 0.0,
    decay_embeddings: bool = True, moe_imbalance: float = 1.0, global_batch: int | None = None,
    lora: "LoraConfig | None" = None, second: SecondModel | None = None,
) -> SearchResult:
    """Estimate every layout of ``world_size`` ranks, with every split of the global batch into micro-batch size
    and accumulation steps (``global_batch``: sequences per optimizer step; default that of ``base`` and
    ``batch``; ``moe_imbalance``: ``estimate_layout``'s; ``lora``: LoRA adapters trained on the frozen model;
    ``second``: the training method's frozen second model, ``estimate_layout``'s)."""
    if global_batch is None:
        global_batch = batch.per_device * (base.dp or world_size // base.model_parallel_size) * batch.accumulation
    result = SearchResult()
    plans: dict[tuple, LayoutPlan | str] = {}
    fsdp_units_of: dict[tuple, tuple[str, ...]] = {}  # per plan key: ZeRO-2/3's units
    cache: dict = {}  # estimate_layout's, shared by the layouts of one plan (the plans above stay alive)
    experts = math.gcd(*divided_experts(model).values())  # 0 for a dense model
    for config in candidates(base, world_size, global_batch, experts, len(trace.layers)):
        label = describe(config)
        share, rest = divmod(global_batch, config.dp)
        if rest:
            result.refused.append((label, f"global batch {global_batch} does not divide over dp={config.dp}"))
            continue
        sizes = [b for b in _divisors(share) if b % config.num_microbatches == 0]
        if not sizes:
            result.refused.append((label, f"per-device share {share} of the global batch does not divide into "
                                          f"{config.num_microbatches} micro-batches"))
            continue
        if config.cp > 1:
            try:
                check_length(batch.seq, config.cp, config.tp, config.sequence_parallel)
            except ConfigError as err:
                result.refused.append((label, str(err)))
                continue
        # One plan per split and sharding: micro-batches (always pp * 2^k here, which every schedule accepts),
        # ep, the ZeRO stage and recomputation change neither; the recompute leaves are planned once and dropped when off.
        key = (config.tp, config.cp, config.pp, config.virtual_pipeline_size, config.pipeline_schedule, config.sp)
        if key not in plans:
            try:
                plans[key] = plan_layout(model, dataclasses.replace(config, dp=None, ep=1, gradient_checkpointing=True),
                                         world_size, registry, lora=lora)
            except (ConfigError, AdapterError) as err:
                plans[key] = str(err)
        plan = plans[key]
        if isinstance(plan, str):
            result.refused.append((label, plan))
            continue
        units: tuple[str, ...] = ()
        if config.fsdp:  # a parameter two units share (the plan above was made without ZeRO-2/3)
            if ("units", key) not in plans:
                fsdp_units_of[key] = fsdp_units(model, plan.leaves)
                try:
                    check_units_share_nothing(model, fsdp_units_of[key], 3)
                    plans["units", key] = ""
                except ConfigError as err:
                    plans["units", key] = str(err)
            if plans["units", key]:
                result.refused.append((label, plans["units", key]))
                continue
            units = fsdp_units_of[key]
        plan = dataclasses.replace(plan, config=config, leaves=plan.leaves if config.gradient_checkpointing else (),
                                   units=units)
        for size in sizes:  # micro-batch size per device; the accumulation steps make up the rank's share
            split = dataclasses.replace(batch, per_device=size, accumulation=share // size)
            estimate = estimate_layout(model, plan, split, precision, trace, weight_decay, decay_embeddings, cache,
                                       moe_imbalance, second, registry)
            if estimate.peak > device.usable_bytes:  # the runtime's reserve kept free (costs.device)
                result.refused.append((f"{label} {batch_split(split)}", f"does not fit: peak "
                                       f"{estimate.peak / 2**30:.2f} GiB > {device.usable_bytes / 2**30:.2f} GiB "
                                       f"usable per device"))
                continue
            seconds = estimate.step_time(device)
            estimate.step_seconds = seconds
            result.ranked.append((estimate, seconds))
    # Equal estimates (splits of one global batch cost the same FLOPs and bytes in the model) go to the fewest
    # accumulation steps: each micro-step has fixed costs the model leaves out (launching every op, reading every
    # weight again), measured on this machine at ~50 ms each for bench/plan_check.py's model (b=1 x8 1.34 s a step,
    # b=8 x1 0.97 s)
    result.ranked.sort(key=lambda item: (float(f"{item[1]:.6g}"), item[0].batch.accumulation))
    return result


def batch_split(batch: Batch) -> str:
    """The micro-batch size and accumulation steps of a ranked layout, for tables."""
    return f"b={batch.per_device} x{batch.accumulation}"


def candidates(base: ParallelConfig, world_size: int, global_batch: int, experts: int = 0,
               layers: int = 2) -> list[ParallelConfig]:
    """The layouts ``search_layouts`` tries (resolved: dp filled in); ``experts``: a number every MoE layer's
    experts divide into (their gcd; 0 for a dense model, which gets ep=1 only); ``layers``: decoder layers, which
    bound the virtual stages (pp x vpp of them)."""
    out = []
    for tp, cp in ((tp, cp) for tp in _divisors(world_size) for cp in _divisors(world_size // tp)):
        for pp in _divisors(world_size // (tp * cp)):
            dp = world_size // (tp * cp * pp)
            per_device = max(1, global_batch // dp)
            virtual = [v for v in (2**k for k in range(1, 8)) if pp * v <= layers]
            looped = [(v, name) for v in virtual for name, schedule in SCHEDULES.items() if schedule.multi_stage]
            for vpp, schedule in [(1, DEFAULT_SCHEDULE)] + (looped if pp > 1 else []):
                micro = [1] if pp == 1 else [pp * 2**k for k in range(8) if pp * 2**k <= per_device] or [pp]
                for m, ep, sp, zero, ckpt in itertools.product(
                        micro, _divisors(math.gcd(experts, dp * cp)) if experts else [1],
                        [True, False] if tp > 1 else [False], _zero_stages(dp * cp, schedule),
                        [False, True]):
                    out.append(dataclasses.replace(
                        base, tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, virtual_pipeline_size=vpp,
                        pipeline_schedule=schedule, num_microbatches=m, sp=sp, zero_1=False, zero_stage=zero,
                        mixed_precision=base.mixed_precision and zero >= 2, gradient_checkpointing=ckpt,
                        pipeline_cuts=()))
    return out


def describe(config: ParallelConfig) -> str:
    """One short line per layout, for tables."""
    parts = [f"tp={config.tp}", f"pp={config.pp}", f"dp={config.dp}"]
    if config.cp > 1:
        parts.append(f"cp={config.cp}" + (f" ({config.cp_attention})" if config.cp_attention != "auto" else ""))
    if config.ep > 1:
        parts.append(f"ep={config.ep}")
    if config.pp > 1:
        parts += [f"vpp={config.virtual_pipeline_size}", f"m={config.num_microbatches}", config.pipeline_schedule]
    if config.sequence_parallel:
        parts.append("sp")
    if config.zero_stage:
        parts.append(f"zero{config.zero_stage}")
    if config.gradient_checkpointing:
        parts.append("recompute")
    return " ".join(parts)


def _zero_stages(replicas: int, schedule: str) -> list[int]:
    """The ZeRO stages worth trying: none without data-parallel ranks; 2 and 3 (FSDP2) not with the zero-bubble
    schedule (``layout_plan.check_zero_stage``)."""
    if replicas == 1:
        return [0]
    return [0, 1] if SCHEDULES[schedule].split_backward else [0, 1, 2, 3]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
