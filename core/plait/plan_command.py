"""``plait plan``: how a model would be split, rendered from the same ``LayoutPlan`` that ``parallelize``
applies (so it shows exactly the layouts ``plait train`` accepts), on a meta model: no weights built; then
what each rank would hold and send (``plait.costs``), or with ``--search`` which layout to use."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shlex
from collections import Counter
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model, takes_images
from plait.costs.activations import ActivationTrace, trace_activations
from plait.costs.vision import VisionTrace, trace_vision
from plait.data.processors import load_processor
from plait.costs.advice import cheaper_settings, fewest_devices
from plait.costs.calibration import calibrate, on_node
from plait.costs.device import PRESETS, Device, parse_memory
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.experts import check_expert_parallel, expert_parameters
from plait.costs.memory import Precision
from plait.costs.render import async_save_note, estimate_json, print_estimate, print_search, search_json
from plait.costs.search import SearchResult, search_layouts
from plait.layout_plan import LayoutPlan, plan_layout
from plait.lora.config import lora_config
from plait.pipeline.layout import rank_of_stage, stage_bytes, stage_rows
from plait.plugin.registry import Registry, default_registry
from plait.run.methods.frozen import SecondModel
from plait.run.methods.table import METHODS
from plait.run.methods.vision_sft import vision_modules
from plait.run.model_config import check_model_fits, read_model_config
from plait.run.train_args import TrainArgs


def parameter_bytes_per_rank(model: torch.nn.Module, specs_by_rank: list[dict], ep: int = 1) -> list[int]:
    """Local parameter bytes of each tp rank (tied parameters counted once; experts divided over ``ep`` ranks)."""
    sizes = {name: p.element_size() for name, p in model.named_parameters()}  # de-duplicated names only
    experts = expert_parameters(model)
    return [sum(math.prod(specs[name].local_shape) * size // (ep if name in experts else 1)
                for name, size in sizes.items()) for specs in specs_by_rank]


def print_pipeline(console: Console, model: torch.nn.Module, plan: LayoutPlan) -> None:
    """The stage (and pipeline rank) of every pipeline unit, and parameter bytes per stage."""
    config, rows = plan.config, stage_rows(model, plan.split)
    table = Table("module", "stage", "pp rank", "parameter bytes (unsharded)")
    for name, stage, size in rows:
        where = ("every stage", "all") if stage is None else (str(stage), str(rank_of_stage(stage, config.pp)))
        table.add_row(name, *where, f"{size:,}")
    console.print(table)
    per_stage = Table("stage", "pp rank", "parameter bytes", f"per tp rank (~/{config.tp})")
    for stage, size in sorted(stage_bytes(rows).items()):
        per_stage.add_row(str(stage), str(rank_of_stage(stage, config.pp)), f"{size:,}", f"{size // config.tp:,}")
    console.print(per_stage)


def print_plan(model: torch.nn.Module, plan: LayoutPlan) -> None:
    """Tables for humans: the style and shapes of every sharded module (repeated layers folded into one
    row), parameter bytes per tp rank, and with pp > 1 the stage of every pipeline unit."""
    console = Console(width=max(Console().width, 140))
    console.print(f"[bold]{type(model).__name__}[/] via adapter {plan.adapter.name!r}: {plan.config.describe()}")
    if plan.cp is not None:
        console.print(f"context parallelism: every sequence split over cp={plan.cp.size} ranks; attention: "
                      f"{plan.cp.describe()}")
    rows: Counter = Counter()
    for name, shard in plan.shards_by_rank[0].items():
        split = ("sharded" + (", kv rows grad summed" if shard.shared_ranges else "")
                 if shard.weight.local_shape != shard.weight.full_shape else
                 "replicated" + (", grad summed" if shard.grad_sum_block > 1 else ""))
        key = (re.sub(r"\.\d+\.", ".*.", name), shard.style.label, split, shard.weight.full_shape,
               shard.weight.local_shape)
        rows[key] += 1
    # "sharded": each rank computes on its slice, nothing gathered in between (fused projections, full-width
    # norms and experts included, where transformers' own plan gathers the activations)
    table = Table("module", "style", "split", "full weight", "rank 0 weight", "count")
    for (name, style, split, full, local), count in rows.items():
        table.add_row(name, style, split, str(full), str(local), str(count))
    console.print(table)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ep = plan.config.ep
    summary = Table("tp rank", "parameter bytes", "share of model")
    for rank, size in enumerate(parameter_bytes_per_rank(model, list(plan.specs_by_rank), ep)):
        summary.add_row(str(rank), f"{size:,}", f"{size / total:.3f}")
    console.print(summary)
    if ep > 1:
        console.print(f"expert parallelism: each rank holds 1/{ep} of every MoE layer's experts (dim 0 of the "
                      f"weights above, after tp's split); ranks of an ep group hold different experts")
    console.print(f"unsharded model: {total:,} parameter bytes; everything not listed above is replicated")
    if plan.split is not None:
        print_pipeline(console, model, plan)


def train_command(args, config, per_device: int, per_node: int | None = None, accumulation: int | None = None) -> str:
    """The ``plait train`` command running ``config`` with the rest of ``args`` (a ``TrainArgs``) unchanged: one
    node launches its processes itself; a world larger than ``per_node`` devices runs under torchrun on each
    node (HOST: the rendezvous node)."""
    world = config.processes
    nodes = -(-world // per_node) if per_node and world > per_node else 1
    flags: list[str] = ["plait", "train"] if nodes == 1 else [
        "torchrun", f"--nnodes={nodes}", f"--nproc_per_node={world // nodes}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=HOST:29500", "-m", "plait", "train"]
    for name in ("model_config", "model_name_or_path", "train_file", "dataset_name", "tokenizer_name", "config",
                 "attn_implementation"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    flags += ["--block_size", str(args.block_size)]
    accumulation = args.gradient_accumulation_steps if accumulation is None else accumulation
    flags += layout_flags(config, per_device, accumulation)
    switches = {"bf16": args.bf16, "bf16_autocast": config.bf16_autocast,
                "disable_embedding_parallelization": config.disable_embedding_parallelization}
    flags += [f"--{name}" for name, on in switches.items() if on]
    if args.bf16 and args.optimizer_dtype != "float32":
        flags += ["--optimizer_dtype", args.optimizer_dtype]
    if args.lora_r:
        defaults = TrainArgs()
        flags += [f"--{name}={getattr(args, name)}" for name in ("lora_r", "lora_alpha", "lora_dropout",
                  "lora_target_modules", "lora_target_parameters") if getattr(args, name) != getattr(defaults, name)]
    if nodes == 1:
        flags += ["--nproc_per_node", str(world)]
    return shlex.join(flags)


def layout_flags(config, per_device: int, accumulation: int) -> list[str]:
    """The ``plait train`` flags that give ``config`` and its batch split (what ``--layout auto`` chooses). The
    accumulation steps are given even at 1: ``--layout auto`` puts these after the user's flags, and argparse
    takes the last of a flag, so a ``--gradient_accumulation_steps`` the user gave must be overridden (it doubled
    the global batch)."""
    flags = ["--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation)]
    flags += ["--tensor_parallel_size", str(config.tp), "--pipeline_parallel_size", str(config.pp)]
    if config.cp > 1:
        flags += ["--context_parallel_size", str(config.cp)]
        if config.cp_attention != "auto":
            flags += ["--cp_attention", config.cp_attention]
    if config.ep > 1:
        flags += ["--expert_parallel_size", str(config.ep)]
        if config.moe_capacity_factor:
            flags += ["--moe_capacity_factor", f"{config.moe_capacity_factor:g}"]
    if config.pp > 1:
        flags += ["--num_microbatches", str(config.num_microbatches), "--pipeline_schedule", config.pipeline_schedule]
        if config.virtual_pipeline_size > 1:
            flags += ["--virtual_pipeline_size", str(config.virtual_pipeline_size)]
    if config.fsdp:
        flags += ["--zero_stage", str(config.zero_stage)]
    switches = {"disable_sequence_parallel": config.tp > 1 and not config.sp, "zero_1": config.zero_1,
                "gradient_checkpointing": config.gradient_checkpointing,
                "disable_expert_tensor_parallel": config.tp > 1 and not config.expert_tensor_parallel}
    return flags + [f"--{name}" for name, on in switches.items() if on]


_RUN = object()  # PlannedRun.search: the run's own LoRA settings


@dataclass
class PlannedRun:
    """One run as ``plait plan`` and ``plait train --layout auto`` estimate it: its meta model, the layout it asks
    for planned on it, the activations traced at its block size, its precision, batch, weight decay and LoRA."""

    args: TrainArgs
    model: nn.Module
    plan: LayoutPlan
    trace: ActivationTrace
    precision: Precision
    lora: object | None
    registry: Registry
    fused_dropout: bool = True  # the device's fused attention takes dropout (``Device.fused_attention_dropout``)
    second: SecondModel | None = None  # the training method's frozen second model (``TrainingMethod.second_model``)
    _traced: dict = field(default_factory=dict)  # parameter dtype -> (meta model, trace), for other precisions

    @classmethod
    def of(cls, args: TrainArgs, parallel: ParallelConfig, world_size: int | None,
           device: Device | None = None, images_per_sample: int = 0) -> "PlannedRun":
        """The run on ``device`` (None: a GPU's attention kernels are assumed); ``images_per_sample``: an
        image-text-to-text model's images a row, whose vision tower is traced (``plait.costs.vision``)."""
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        registry = default_registry()
        model = build_meta_model(read_model_config(args), dtype)
        check_expert_parallel(model, parallel.ep)
        lora = args.lora()  # LoRA: the base frozen (no gradients, no optimizer state), the adapters trained
        plan = plan_layout(model, parallel, world_size, registry, lora=lora)
        fused = device is None or device.fused_attention_dropout
        trace = trace_activations(model, args.block_size, registry, plan.adapter, fused)
        if images_per_sample or takes_images(model.config):
            trace = dataclasses.replace(trace, vision=vision_of(args, model, images_per_sample, trace.squares))
        precision = Precision(dtype, getattr(torch, args.optimizer_dtype) if args.bf16 else dtype)
        second = METHODS[args.method].second_model(args, model, dtype)  # a reference, a teacher: in the memory
        return cls(args, model, plan, trace, precision, lora, registry, fused, second, {dtype: (model, trace)})

    @property
    def batch(self) -> Batch:
        a = self.args
        # DPO: an example is a pair, its chosen and rejected rows side by side (plait.run.methods.dpo)
        return Batch(a.per_device_train_batch_size, a.block_size, a.gradient_accumulation_steps,
                     rows_per_example=2 if a.method == "dpo" else 1)

    @property
    def decay(self) -> dict:
        return {"weight_decay": self.args.weight_decay,
                "decay_embeddings": not self.args.exclude_embeddings_from_weight_decay}

    def global_batch(self) -> int:
        """Sequences per optimizer step, as the flags write it for the layout asked for."""
        return self.batch.per_device * (self.plan.config.dp or 1) * self.batch.accumulation

    def search(self, device: Device, world: int | None = None, precision: Precision | None = None, lora=_RUN,
               global_batch: int | None = None, moe_imbalance: float = 1.0) -> SearchResult:
        """``search_layouts`` for this run, at another world, precision or LoRA setting where given."""
        precision = precision or self.precision
        if precision.param not in self._traced:  # the activations of bf16 parameters are bf16 too
            other = build_meta_model(read_model_config(self.args), precision.param)
            traced = trace_activations(other, self.args.block_size, self.registry, self.plan.adapter,
                                       self.fused_dropout)
            if self.trace.vision is not None:  # the same images, in this precision
                images = self.trace.vision.images
                traced = dataclasses.replace(traced, vision=vision_of(self.args, other, images, traced.squares))
            self._traced[precision.param] = (other, traced)
        model, trace = self._traced[precision.param]
        return search_layouts(model, self.plan.config, world or self.plan.config.processes, self.batch, precision,
                              trace, device, self.registry, **self.decay, moe_imbalance=moe_imbalance,
                              global_batch=global_batch, lora=self.lora if lora is _RUN else lora, second=self.second)


def vision_of(args: TrainArgs, model: torch.nn.Module, images: int, squares: bool) -> VisionTrace:
    """The vision tower of ``model`` traced on one 512x512 picture as the processor beside its weights prepares
    it (at 0 images: where it sits, so that its weights leave the decoder's per-token FLOPs); one line for a model
    without a processor or a vision tower."""
    from PIL import Image

    towers, projectors = vision_modules(model)
    if not towers:
        raise ConfigError(f"--images_per_sample {images}: {type(model).__name__} has no vision tower; drop it")
    if not images:
        return VisionTrace(0, 0, 0.0, tuple(towers + projectors))
    folder = args.tokenizer_name or args.model_name_or_path
    if folder is None:
        raise ConfigError(f"--images_per_sample {images} traces the vision tower on an image its processor prepares: "
                          f"give --model_name_or_path (or --tokenizer_name) a directory holding the processor")
    out = load_processor(folder).image_processor(images=[Image.new("RGB", (512, 512))], return_tensors="pt")
    pixels = {name: value for name, value in out.items() if isinstance(value, torch.Tensor)}
    return trace_vision(model, pixels, images, tuple(towers + projectors), squares)


def run_plan(ns, args) -> None:
    """``plait plan``: the layout tables, memory per rank, communication and bubble of the layout asked for,
    or with ``--search`` the fastest layouts that fit (``ns``: the parsed plan flags; ``args``: TrainArgs)."""
    if ns.world_size is not None and ns.world_size < 1:  # 0 planned the smallest world as if not given
        raise ConfigError(f"--world_size={ns.world_size} must be positive (processes of the run)")
    if ns.top < 1:  # 0 printed "no layout fits" under a count of those that fit
        raise ConfigError(f"--top={ns.top} must be positive (the fastest layouts --search prints)")
    if ns.hardware and (ns.calibrate or ns.recalibrate):  # the calibration was used and --hardware ignored
        raise ConfigError(f"--hardware {ns.hardware} and --calibrate both name the device: give one")
    parallel = args.parallel_config()
    # None: tp*cp*pp, the smallest world of the layout; under ep as many dp replicas as the ep group needs
    world_size = ns.world_size or (args.nproc_per_node if args.nproc_per_node > 1 else None)
    if world_size is None and parallel.ep > 1:
        world_size = parallel.tp * parallel.pp * math.lcm(parallel.cp, parallel.ep)
    memory = parse_memory(ns.device_memory) if ns.device_memory is not None else None
    if ns.moe_imbalance < 1:
        raise ConfigError(f"--moe_imbalance={ns.moe_imbalance:g} must be >= 1 (1: balanced routing; F: the busiest "
                          f"ep rank computes F times its even share of the (token, expert) pairs)")
    device = calibrate(refresh=ns.recalibrate) if ns.calibrate or ns.recalibrate else (
        PRESETS[ns.hardware] if ns.hardware else None)
    if device is not None and memory is not None:  # the user's figure is what the tensors may take: no reserve
        device = dataclasses.replace(device, memory_bytes=memory, reserve_bytes=0, fragmentation=0.0)
    elif device is not None:  # a CPU's host shared by this run's ranks on the node (the smallest world's if none)
        device = on_node(device, world_size or parallel.tp * parallel.cp * parallel.pp)
    memory = memory or (device.memory_bytes if device else None)
    if ns.search and device is None:
        raise ConfigError("--search ranks layouts by estimated step time: give a device model, --hardware "
                          f"({', '.join(PRESETS)}) or --calibrate (measure this machine)")
    if ns.images_per_sample < 0:
        raise ConfigError(f"--images_per_sample={ns.images_per_sample} must be >= 0")
    if not ns.search:  # the layout asked for is the run's: refused as plait train refuses it (the search tries many)
        args.check_flags_take_effect()
        check_model_fits(args, read_model_config(args))
    run = PlannedRun.of(args, parallel, world_size, device, ns.images_per_sample)
    console = Console(width=max(Console().width, 140))
    if ns.search:
        world = run.plan.config.processes
        search = functools.partial(run.search, device, moe_imbalance=ns.moe_imbalance,
                                   global_batch=ns.global_batch_size or run.global_batch())
        result = search()
        commands = [train_command(args, e.plan.config, e.batch.per_device, device.per_node, e.batch.accumulation)
                    for e, _ in result.ranked[:ns.top]]
        advice = None
        if not result.ranked:  # what would fit: more devices per strategy, or a cheaper setting on these
            advice = (fewest_devices(lambda w: search(world=w), world),
                      cheaper_settings(lambda p, adapters: search(precision=p, lora=adapters), run.precision,
                                       run.lora, lambda: lora_config(16, 32.0)))
        if ns.json:
            print(json.dumps(search_json(result, device, commands, ns.top, advice), indent=2))
        else:
            print_search(console, result, device, commands, ns.top, ns.show_refused, advice)
        return
    model, plan = run.model, run.plan
    estimate = estimate_layout(model, plan, run.batch, run.precision, run.trace, **run.decay,
                               moe_imbalance=ns.moe_imbalance, second=run.second, registry=run.registry)
    if ns.json:
        print(json.dumps(estimate_json(estimate, device, memory), indent=2))
        return
    print_plan(model, plan)
    print_estimate(console, estimate, device, memory)
    if args.save_async:
        console.print(async_save_note(estimate))
