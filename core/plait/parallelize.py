"""``parallelize(model, config)``: the one entry point, applying a layout plan in a fixed order.

config -> ``plan_layout`` (adapter, plans, every refusal; no communication) -> mesh (process groups) ->
rank 0's weights on every rank (a model that holds them: plait.parallel.replicas) -> pipeline pruning (drop other
stages' modules) -> tensor parallel layers -> float8 -> sequence parallel region -> activation checkpointing ->
gradient sync -> pipeline runner -> ParallelModel. Data flows one way: each step is built from the ones before it
and handed to the next, and nothing is patched in afterwards.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.base.batches import local_microbatch
from plait.base.config import ConfigError, ParallelConfig
from plait.base.mesh import Mesh
from plait.cp.attention import install_context_parallel
from plait.cp.context import ContextParallel
from plait.cp.router import install_router_gather
from plait.cp.sequence import check_length
from plait.ep.apply import AppliedEP, apply_expert_parallel
from plait.layout_plan import LayoutPlan, plan_layout
from plait.lora.layers import LoraDropout, apply_lora
from plait.parallel.activation_checkpoint import apply_activation_checkpointing
from plait.parallel.compile import compile_leaf_modules
from plait.parallel.float8 import apply_float8, check_float8_device, check_float8_tokens
from plait.parallel.fsdp import AppliedFSDP, apply_fsdp, remap_params
from plait.parallel.grad_sync import GradSync, norm_params
from plait.parallel.moe_balance import GlobalBalance, aux_divisor, global_balance
from plait.parallel.replicas import broadcast_from_first
from plait.pipeline.runner import PipelineRunner
from plait.pipeline.stages import StageChunk, dropped, prune
from plait.plugin.registry import Adapter, Registry
from plait.tp.apply import AppliedTP, apply_tensor_parallel
from plait.tp.logprobs import Objective, read_logits
from plait.tp.loss import CausalLMLoss, num_items_in_batch as count_label_tokens
from plait.tp.rng import install_dropout_rng
from plait.tp.sequence_parallel import install_sequence_parallel, region_prefix, sp_grad_sum_params
from plait.tp.sharding import ModuleShard, ShardSpec
from plait.tp.styles import Row

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig


def precision_context(config: ParallelConfig, module: nn.Module) -> contextlib.AbstractContextManager:
    """torch.autocast(bfloat16) around a forward pass when the config asks for it, on the parameters' device
    type (looked up at call time: a model laid out on the meta device is materialised later)."""
    if not config.bf16_autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(module.parameters()).device.type, dtype=torch.bfloat16)


class ParallelModel(nn.Module):
    """A transformers causal LM laid out over a mesh.

    The trainer drives it with one call per optimizer step, the same for every layout:
    ``loss = pmodel.train_step(input_ids, labels, attention_mask, num_items_in_batch)`` runs forward and
    backward over ``num_microbatches`` microbatches (through the pipeline schedule when pp > 1); then
    ``pmodel.grad_sync`` sums the gradients of parameters shared across ranks (``OptimizerStep`` drives it).
    Losses are normalised by the global token count (``num_items_in_batch``), so that summing over dp
    ranks and microbatches gives the exact mean. ``forward`` (pp=1 only) returns one batch's loss or this
    rank's vocab slice of the logits.

    Under ``moe_aux_loss_scope="global_batch"`` the router's load-balancing loss is the global batch's
    (plait.parallel.moe_balance): every ``train_step``, ``eval_loss`` and ``forward`` with labels first runs a routing
    pass (no-grad forwards) over its batch, so by default a call's batch over every dp rank is the global batch;
    ``set_global_batch`` names the batches of several ``train_step`` calls (gradient accumulation) instead.
    """

    def __init__(
        self, module: nn.Module, mesh: Mesh, plan: LayoutPlan, applied: AppliedTP, grad_sync: GradSync,
        loss_fn: CausalLMLoss, pipeline: PipelineRunner | None, cp: ContextParallel | None = None,
        experts: AppliedEP | None = None, fsdp: AppliedFSDP | None = None, balance: GlobalBalance | None = None,
    ) -> None:
        super().__init__()
        self.module, self.mesh, self.plan, self.applied = module, mesh, plan, applied
        self.grad_sync, self.loss, self.pipeline, self.cp = grad_sync, loss_fn, pipeline, cp
        self.experts = experts or AppliedEP()  # expert parallelism's parameters and dispatches (empty at ep=1)
        self.lora_base: dict | None = None  # a LoRA run's frozen weights: where from (plait.lora.base)
        self.aux_loss_sum: torch.Tensor | None = None  # training forwards' aux-loss terms (moe_metrics reads)
        self.balance = balance  # the global-batch load-balancing loss (None: micro_batch scope, or no aux loss)
        self.calls_per_step = 1  # train_step calls of one optimizer step, as set_global_batch last named them
        self.fsdp = fsdp  # ZeRO-2/3: the FSDP2 units (None without)
        # shard spec of every parameter of ``module`` on this rank (names as in the original model)
        self.param_specs: dict[str, ShardSpec] = local_specs(module, plan, mesh, fsdp)

    @property
    def adapter(self) -> Adapter:
        return self.plan.adapter

    @property
    def config(self) -> ParallelConfig:
        return self.mesh.config

    def torch_compile(self, leaf_patterns: Sequence[str]) -> list[str]:
        """What ``--torch_compile`` compiles: each leaf module (decoder layer) in place, and the loss where this
        rank holds the whole vocabulary (``CausalLMLoss.compile``). Returns the compiled modules' names."""
        names = compile_leaf_modules(self.module, leaf_patterns)
        self.loss.compile()
        return names

    def local_batch(self, tensor: torch.Tensor, accumulation_steps: int = 1, micro_step: int = 0) -> torch.Tensor:
        """This rank's rows of a global batch ``tensor`` (ids, labels, mask or positions) for ``train_step`` or
        ``eval_loss``: its dp replica's contiguous slice (of micro-step ``micro_step`` of ``accumulation_steps``);
        the tp, cp and pp ranks of a replica pass the same rows (cp ranks take their tokens inside)."""
        rows = local_microbatch(torch.arange(tensor.shape[0]), self.mesh.dp_rank, self.mesh.dp, accumulation_steps,
                                micro_step)
        return tensor[rows.to(tensor.device)]

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss from this rank's share (what ``train_step`` and ``eval_loss`` return when given
        the global ``num_items_in_batch``): the sum over the ranks that split the batch (dp x cp), equal on every
        rank. A collective: every rank calls it."""
        return comm.all_reduce(loss.detach().clone(), self.mesh.replica_group)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss when ``labels`` are given (causal shift inside), else this rank's vocab slice of the logits.

        Under cp the logits are this rank's tokens' (``self.cp.take`` picks the matching slice of a whole
        tensor) and the loss is this rank's share: summed over the cp group it is the whole batch's."""
        if self.pipeline is not None:
            raise ConfigError(
                f"forward() runs the whole model, but pp={self.mesh.pp} spreads it over ranks; call "
                f"train_step() or eval_loss(), which run the pipeline schedule"
            )
        self._check_sequence(input_ids, attention_mask)
        if self.cp is not None and labels is not None and num_items_in_batch is None:  # whole sequences' count
            num_items_in_batch = count_label_tokens(labels).clamp(min=1)
        if self.balance is not None and labels is not None:  # its own batch's balance, a step's left as it was
            with self.balance.kept():
                self._routing_pass([(input_ids, attention_mask, position_ids)], one_forward=True)
                return self._forward(input_ids, labels, attention_mask, num_items_in_batch, position_ids)
        return self._forward(input_ids, labels, attention_mask, num_items_in_batch, position_ids)

    def _forward(self, input_ids, labels, attention_mask, num_items_in_batch, position_ids=None, objective=None,
                 rows=None) -> torch.Tensor:
        if self.cp is not None:  # this rank's tokens, the whole sequence's positions and mask at hand
            batch, seq = input_ids.shape
            labels = None if labels is None else self.cp.shard_labels(labels)
            with self.cp.forward(batch, seq, attention_mask, position_ids, input_ids.device) as local:
                out = self._model(self.cp.take(input_ids), local.get("attention_mask"), local["position_ids"])
        else:
            out = self._model(input_ids, attention_mask, position_ids)
        if labels is None:
            return out.logits
        if objective is not None:  # a training method's own loss from the logits (plait.tp.logprobs)
            loss = objective(read_logits(out.logits, labels, rows, self.loss, self.mesh))
        else:
            loss = self.loss(out.logits, labels, num_items_in_batch)
        if self.balance is not None:  # the global batch's load balancing: this forward's part (plait.parallel.moe_balance)
            term = self.balance.term(out.router_logits, attention_mask) / aux_divisor(self.config)
            if torch.is_grad_enabled():
                self.aux_loss_sum = term.detach() + (0 if self.aux_loss_sum is None else self.aux_loss_sum)
            return loss + term
        aux = getattr(out, "aux_loss", None)  # MoE load balancing, when the config sets output_router_logits
        if aux is not None:
            # transformers adds coef * aux per forward; plait trains on its mean over a step's forwards (the
            # microbatches of every dp rank, in each of the step's train_step calls that set_global_batch named),
            # which the gradient sum over dp, microbatches and calls makes exact. Under cp every rank computes the
            # whole forward's aux (plait.cp.router) and adds 1/cp of it.
            coef = self.module.config.router_aux_loss_coef
            term = aux * (coef / aux_divisor(self.config, self.calls_per_step))
            if torch.is_grad_enabled():  # a training forward (not evaluation): the step's metrics report the sum
                self.aux_loss_sum = term.detach() + (0 if self.aux_loss_sum is None else self.aux_loss_sum)
            loss = loss + term
        return loss

    def _model(self, input_ids, attention_mask, position_ids, **cache) -> Any:
        extra = {"use_cache": False, **cache} | ({} if position_ids is None else {"position_ids": position_ids})
        try:
            with precision_context(self.config, self.module):  # cache: the KV cache, use_cache (plait.generation)
                return self.module(input_ids=input_ids, attention_mask=attention_mask, **extra)
        finally:
            self.applied.entry.clear()

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        objective: Objective | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one optimizer step's local batch, split into ``num_microbatches``;
        gradients accumulate into ``.grad``. Returns the loss (summed over microbatches: the step's loss
        when ``num_items_in_batch`` is the global token count) on every rank of the pipeline.

        ``num_items_in_batch``: tokens with a label in the global batch (all dp ranks); None counts this
        rank's batch, right only for dp=1. Sync gradients afterwards (``OptimizerStep`` or ``grad_sync``).
        ``position_ids`` ([batch, seq], whole sequences): restarting at 0 inside a row marks packed documents,
        which transformers' mask then keeps apart (block-diagonal attention, on every pipeline stage).
        ``objective``: a training method's loss instead of the cross-entropy (DPO's, ...): called with each
        microbatch's logits on the ranks that compute the loss (the last pipeline stage), it returns this rank's
        share of the step's loss (``plait.tp.logprobs``); ``num_items_in_batch`` is then unused.
        """
        if self.balance is not None:
            self._balance_for(input_ids, attention_mask, position_ids)
        return self._run(input_ids, labels, attention_mask, num_items_in_batch, position_ids, train=True,
                         objective=objective)

    def set_global_batch(
        self, batches: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
    ) -> None:
        """Name the batches of the next ``len(batches)`` ``train_step`` calls, (input_ids, attention_mask,
        position_ids) each as those calls will get them: under ``moe_aux_loss_scope="global_batch"`` the
        load-balancing loss is then the one of all of them over every dp rank (one optimizer step's gradient
        accumulation), counted now in one routing pass; the calls must follow in this order with these batches
        (their shapes are checked). Under micro_batch it only counts the calls: the aux term is averaged over every
        forward of them, not summed over the calls. Every rank calls it (a collective over dp)."""
        self.calls_per_step = max(len(batches), 1)
        if self.pipeline is not None:
            self.pipeline.aux_divisor = aux_divisor(self.config, self.calls_per_step)
        if self.balance is None or not batches:
            return
        self._routing_pass(batches)
        self.balance.pending = [tuple(ids.shape) for ids, _, _ in batches]

    def _balance_for(self, input_ids, attention_mask, position_ids) -> None:
        """The weights of the global batch a ``train_step`` call belongs to: named by ``set_global_batch``, or
        its own batch (over every dp rank), counted now."""
        if not self.balance.pending:
            self._routing_pass([(input_ids, attention_mask, position_ids)])
            return
        expected = self.balance.pending.pop(0)
        if tuple(input_ids.shape) != expected:
            self.balance.pending = []
            raise ConfigError(
                f"train_step got input_ids of shape {tuple(input_ids.shape)}, but set_global_batch named a batch of "
                f"shape {expected} for this call; pass set_global_batch the batches of the coming train_step calls, "
                f"in their order"
            )

    def _routing_pass(self, batches, one_forward: bool = False) -> None:
        """Count the routing of ``batches`` over every dp rank (plait.parallel.moe_balance): each run forward without
        autograd as its call will run it (``train_step``'s microbatches and pipeline schedule, or ``forward``'s
        one pass), so that the counts are of the very logits the training forwards route by. The labels are
        the ids: the loss computed beside is thrown away."""
        with torch.no_grad(), self.balance.routing_pass():
            for ids, mask, positions in batches:
                if one_forward:
                    self._forward(ids, ids, mask, 1, positions)
                else:
                    self._run(ids, ids, mask, 1, positions, train=False)
        self.balance.finish()

    def eval_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        objective: Objective | None = None,
    ) -> torch.Tensor:
        """``train_step`` without backward (validation loss, or an ``objective``'s), on every rank of the pipeline."""
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if self.balance is not None:  # its own batch's balance, leaving a training step's as it was
                stack.enter_context(self.balance.kept())
                self._routing_pass([(input_ids, attention_mask, position_ids)])
            return self._run(input_ids, labels, attention_mask, num_items_in_batch, position_ids, train=False,
                             objective=objective)

    def _check_sequence(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, microbatches: int = 1,
        train: bool | None = None,
    ) -> None:
        if attention_mask is not None and (self.config.sequence_parallel or self.cp is not None) and \
                getattr(self.module.config, "output_router_logits", False):
            where = "context parallelism" if self.cp is not None else "sequence parallelism"
            raise ConfigError(
                f"an attention_mask with output_router_logits under {where}: the router loss gathers the logits of "
                f"sequence shards rank by rank, out of the mask's order; pack sequences without a mask, disable "
                f"{where}, or set output_router_logits=False"
            )
        seq = input_ids.shape[1]
        if self.plan.float8 and (torch.is_grad_enabled() if train is None else train):
            check_float8_tokens(self.config, input_ids.shape[0] // microbatches * seq // self.mesh.cp)
        if self.cp is not None:
            check_length(seq, self.cp.size, self.mesh.tp, self.config.sequence_parallel)
        elif self.config.sequence_parallel and seq % self.mesh.tp:
            raise ConfigError(
                f"sequence length {seq} is not divisible by tp={self.mesh.tp} under sequence parallelism; "
                f"use a block size that is a multiple of {self.mesh.tp}, or disable sequence parallelism"
            )

    def _run(self, input_ids, labels, attention_mask, num_items_in_batch, position_ids, train: bool,
             objective: Objective | None = None) -> torch.Tensor:
        """Checks first (identical on every rank, so a refusal never leaves a peer inside a collective)."""
        m = self.config.num_microbatches
        self._check_sequence(input_ids, attention_mask, m, train)
        if input_ids.shape[0] % m:
            raise ConfigError(
                f"a local batch of {input_ids.shape[0]} sequences is not divisible by num_microbatches={m}; "
                f"use a per-rank batch that is a multiple of {m}"
            )
        if num_items_in_batch is None:
            num_items_in_batch = count_label_tokens(labels).clamp(min=1)
        if self.pipeline is not None:
            if self.cp is not None:  # stages get this rank's tokens and the whole positions (StageChunk)
                if position_ids is None:
                    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
                input_ids, labels = self.cp.take(input_ids), self.cp.shard_labels(labels)
            return self.pipeline.run(input_ids, labels, attention_mask, num_items_in_batch, train, position_ids,
                                     objective)
        total = None  # in the loss's own dtype: fp32 at least, float64 for a float64 model
        masks = attention_mask.chunk(m) if attention_mask is not None else [None] * m
        positions = position_ids.chunk(m) if position_ids is not None else [None] * m
        rows = [None] * m  # each microbatch's rows in the batch: what an objective reads them by
        if objective is not None:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device).chunk(m)
        for i, (ids, labs, mask, pos) in enumerate(zip(input_ids.chunk(m), labels.chunk(m), masks, positions)):
            loss = self._forward(ids, labs, mask, num_items_in_batch, pos, objective, rows[i])
            if train:
                if self.fsdp is not None:
                    self.fsdp.keep_gathered(i < m - 1)
                loss.backward()
            total = loss.detach().clone() if total is None else total + loss.detach()
        return total


def check_world_started(config: ParallelConfig) -> None:
    """Refuse, saying how to start one, a layout of several processes where no torch.distributed world runs:
    the script was started without torchrun, or under torchrun without joining its process group."""
    needed = config.processes
    if needed == 1:
        return
    layout = f"the layout ({config.describe()}) needs {needed} processes"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"{layout}, and this process is one of torchrun's {os.environ['WORLD_SIZE']} but has not "
                          f"joined their group; call torch.distributed.init_process_group() before parallelize")
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
    applied = apply_tensor_parallel(model, shards, mesh, config.sequence_parallel)
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
        fsdp = apply_fsdp(model, [name for name in plan.units if owns(name)], mesh.replica_group, config.zero_stage,
                          config.mixed_precision)
        new = remap_params(before, model)
        sp_params = [new[id(p)] for p in sp_params]
        applied.grad_sums = [(new[id(p)], group, part) for p, group, part in applied.grad_sums]
    grad_sync = _grad_sync(model, plan, mesh, applied, sp_params, experts.params, local_specs(model, plan, mesh, fsdp))
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


def local_specs(model: nn.Module, plan: LayoutPlan, mesh: Mesh, fsdp: AppliedFSDP | None) -> dict[str, ShardSpec]:
    """The shard spec of every parameter ``model`` holds on this rank: its tp shard, its experts under ep, its
    rows under ZeRO-2/3."""
    local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    specs = plan.specs_by_rank[mesh.tp_rank]
    if plan.ep is not None:
        specs = plan.ep.localize(specs, mesh.ep_rank)
    return {name: fsdp.rows(spec) if fsdp is not None else spec for name, spec in specs.items() if name in local}


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
    return CausalLMLoss(applied.vocab_start, mesh.tp_group if applied.head_is_parallel else None, shift)