"""``parallelize(model, config)``: the one entry point, applying plans in a fixed order.

config -> adapter (by architecture) -> plans (pure data) -> validation (no communication yet) -> mesh
(process groups) -> pipeline pruning (drop other stages' modules) -> tensor parallel layers -> sequence
parallel region -> activation checkpointing -> pipeline stages -> ParallelModel.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.checkpointing import apply_activation_checkpointing, checkpoint_targets
from plait.config import ConfigError, ParallelConfig
from plait.grad_sync import sum_grads
from plait.mesh import Mesh
from plait.pipeline.layout import plan_stages, stages_of_rank, tied_across_stages
from plait.pipeline.schedule import PipelineRunner
from plait.pipeline.stages import StageChunk, dropped, prune
from plait.registry import Adapter, Registry, default_registry
from plait.tp.sequence_parallel import install_sequence_parallel, sp_grad_sum_params
from plait.tp.sharding import ShardSpec, param_specs, plan_tensor_parallel
from plait.tp.apply import AppliedTP, apply_tensor_parallel
from plait.tp.loss import IGNORE_INDEX, vocab_parallel_cross_entropy


class ParallelModel(nn.Module):
    """A transformers causal LM laid out over a mesh.

    The trainer drives it with one call per optimizer step, the same for every layout:
    ``loss = pmodel.train_step(input_ids, labels, attention_mask, num_items_in_batch)`` runs forward and
    backward over ``num_microbatches`` microbatches (through the pipeline schedule when pp > 1), then
    ``pmodel.finish_grad_sync()`` sums gradients of parameters shared across ranks (sequence-parallel
    norms, replicated kv heads, tied embeddings on the two pipeline ends) and over data-parallel ranks.
    Losses are normalised by the global token count (``num_items_in_batch``), so that summing over dp
    ranks and microbatches gives the exact mean. ``forward`` (pp=1 only) returns one batch's loss or
    this rank's vocab slice of the logits.
    """

    def __init__(
        self, module: nn.Module, mesh: Mesh, adapter: Adapter, applied: AppliedTP,
        specs_by_rank: list[dict[str, ShardSpec]], sp_params: list[nn.Parameter],
        tied_params: list[nn.Parameter] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.mesh, self.adapter, self._applied = mesh, adapter, applied
        self._specs_by_rank = specs_by_rank
        self._tp_sums: dict[Any, list[nn.Parameter]] = defaultdict(list)
        for param in sp_params:
            self._tp_sums[mesh.tp_group].append(param)
        for param, group in applied.grad_sums:
            self._tp_sums[group].append(param)
        self._tied_params = tied_params or []
        self.pipeline: PipelineRunner | None = None  # set by parallelize when pp > 1
        # bf16 autocast with fp32 parameters: set to torch.bfloat16 to run every forward (and only the
        # forward: backward follows the dtypes autocast chose) under torch.autocast.
        self.autocast_dtype: torch.dtype | None = None

    def forward_context(self) -> contextlib.AbstractContextManager:
        """torch.autocast around a forward pass when ``autocast_dtype`` is set, on the parameters' device type."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=next(self.parameters()).device.type, dtype=self.autocast_dtype)

    @property
    def config(self) -> ParallelConfig:
        return self.mesh.config

    @property
    def param_specs(self) -> dict[str, ShardSpec]:
        """Shard spec of every parameter of ``module`` on this rank (names as in the original model)."""
        return self._specs_by_rank[self.mesh.tp_rank]

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss when ``labels`` are given (causal shift inside), else this rank's vocab slice of the logits."""
        if self.pipeline is not None:
            raise ConfigError(
                f"forward() runs the whole model, but pp={self.mesh.pp} spreads it over ranks; call "
                f"train_step() or eval_loss(), which run the pipeline schedule"
            )
        self._check_sequence(input_ids)
        try:
            with self.forward_context():
                logits = self.module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        finally:
            self._applied.entry.clear()
        if labels is None:
            return logits
        return self.loss(logits, labels, num_items_in_batch)

    def loss(
        self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """The causal-LM loss of this rank's logits (vocab-parallel when the head is split over tp)."""
        group = self.mesh.tp_group if self._applied.head_is_parallel else None
        return vocab_parallel_cross_entropy(logits, labels, self._applied.vocab_start, group, num_items_in_batch)

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one optimizer step's local batch, split into ``num_microbatches``;
        gradients accumulate into ``.grad``. Returns the loss (summed over microbatches: the step's loss
        when ``num_items_in_batch`` is the global token count) on every rank of the pipeline.

        ``num_items_in_batch``: tokens with a label in the global batch (all dp ranks); None counts this
        rank's batch, right only for dp=1. Call ``finish_grad_sync()`` afterwards.
        """
        return self._run(input_ids, labels, attention_mask, num_items_in_batch, train=True)

    def eval_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``train_step`` without backward (validation loss), on every rank of the pipeline."""
        with torch.no_grad():
            return self._run(input_ids, labels, attention_mask, num_items_in_batch, train=False)

    def _check_sequence(self, input_ids: torch.Tensor) -> None:
        seq = input_ids.shape[1]
        if self.config.sequence_parallel and seq % self.mesh.tp:
            raise ConfigError(
                f"sequence length {seq} is not divisible by tp={self.mesh.tp} under sequence parallelism; "
                f"use a block size that is a multiple of {self.mesh.tp}, or disable sequence parallelism"
            )

    def _run(self, input_ids, labels, attention_mask, num_items_in_batch, train: bool) -> torch.Tensor:
        """Checks first (identical on every rank, so a refusal never leaves a peer inside a collective)."""
        self._check_sequence(input_ids)
        m = self.config.num_microbatches
        if input_ids.shape[0] % m:
            raise ConfigError(
                f"a local batch of {input_ids.shape[0]} sequences is not divisible by num_microbatches={m}; "
                f"use a per-rank batch that is a multiple of {m}"
            )
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
        if self.pipeline is not None:
            return self.pipeline.run(input_ids, labels, attention_mask, num_items_in_batch, train)
        total = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        masks = attention_mask.chunk(m) if attention_mask is not None else [None] * m
        for ids, labs, mask in zip(input_ids.chunk(m), labels.chunk(m), masks):
            loss = self(ids, labs, mask, num_items_in_batch)
            if train:
                loss.backward()
            total += loss.detach().float()
        return total

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from every tp rank's slice (inference, tests); padding never shows."""
        if not self._applied.head_is_parallel:
            return local_logits
        per_rank = self._applied.vocab_per_rank
        padded = torch.nn.functional.pad(local_logits, (0, per_rank - local_logits.shape[-1]))
        # Real vocab rows are contiguous from 0 across ranks and padding sits at the end, so concatenating
        # the padded slices and cutting at the vocab size gives the full logits.
        return comm.all_gather(padded, self.mesh.tp_group, dim=-1)[..., : self._applied.vocab_size]

    def finish_grad_sync(self, *, dp: bool = True) -> None:
        """Sum gradients over the tp groups that share parameters, over the two pipeline ends for tied
        embeddings (so both copies take identical steps), then (``dp``) over data-parallel ranks.

        ``dp=False`` leaves the data-parallel reduction to the optimizer step: ZeRO-1 reduces each gradient
        only to the rank that updates it (``plait.optim.OptimizerStep`` does this once per step).
        """
        for group, params in self._tp_sums.items():
            sum_grads(params, group)
        if self._tied_params:
            sum_grads(self._tied_params, self.mesh.pipeline_ends_group())
        if dp:
            sum_grads([p for p in self.parameters() if p.requires_grad], self.mesh.dp_group)

    def grad_norm_params(self) -> list[nn.Parameter]:
        """The parameters whose gradients this rank counts in the global gradient norm.

        Every distinct slice of every logical parameter is counted on exactly one rank of the tp group:
        a tp-sharded slice on its rank, a replicated parameter (or a kv head shared by a block of ranks,
        whose ShardSpec is then equal across the block) on the first rank holding that same slice. A tied
        embedding held by both pipeline ends is counted on the first stage only. Summing the squares over
        tp (and pp, and dp for the slices each dp rank updates) gives the norm of the single-process model.
        """
        counted = []
        second_copies = {id(p) for p in self._tied_params} if self.mesh.pp_rank > 0 else set()
        for name, param in self.module.named_parameters():
            spec = self.param_specs[name]
            if id(param) in second_copies:
                continue
            if not any(self._specs_by_rank[r][name] == spec for r in range(self.mesh.tp_rank)):
                counted.append(param)
        return counted

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full logical tensor of parameter ``name`` (or of its gradient) from every tp rank's shard."""
        spec = self.param_specs[name]
        if spec.dim is None:
            return local.detach().clone()
        pieces = comm.all_gather(local.detach().unsqueeze(0), self.mesh.tp_group, dim=0)
        full = local.new_zeros(spec.full_shape)
        for rank, piece in enumerate(pieces):
            self._specs_by_rank[rank][name].place(piece, full)
        return full


def _check_capabilities(adapter: Adapter, config: ParallelConfig, model_config: Any) -> None:
    caps = adapter.info.capabilities
    wanted = {"tp": config.tp > 1, "sp": config.sequence_parallel, "pp": config.pp > 1,
              "vpp": config.virtual_pipeline_size > 1,
              "tied_embeddings": config.tp * config.pp > 1 and bool(getattr(model_config, "tie_word_embeddings", False))}
    refused = [name for name, needed in wanted.items() if needed and not getattr(caps, name)]
    if refused:
        raise ConfigError(
            f"adapter {adapter.name!r} does not support {', '.join(refused)} (it supports: "
            f"{', '.join(caps.supported()) or 'nothing'}); change the layout ({config.describe()})"
        )


@dataclass
class _Plans:
    """What parallelize applies, computed (and checked) from the model's structure alone."""

    split: Any
    tied: list[list[str]]
    shards_by_rank: list[dict]
    sp_plan: Any
    leaves: list[str]


def _plan(model: nn.Module, config: ParallelConfig, registry: Registry, adapter: Adapter) -> _Plans:
    """Every layout check that needs the model: no communication, no weight values (meta tensors do)."""
    _check_capabilities(adapter, config, model.config)
    split = plan_stages(model, config, registry, adapter) if config.pp > 1 else None
    tied = tied_across_stages(model, split) if split is not None else []
    parallel_embeddings = not config.disable_embedding_parallelization
    tp_plan = registry.tp_plan(adapter, model.config) if config.tp > 1 else None
    shards_by_rank = [
        plan_tensor_parallel(model, tp_plan, config.tp, r, parallel_embeddings) if tp_plan else {}
        for r in range(config.tp)
    ]
    sp_plan = registry.sp_plan(adapter, model.config) if config.sequence_parallel else None
    if sp_plan is not None:
        sp_grad_sum_params(model, sp_plan, shards_by_rank[0])  # validates the plan against the model
    leaves = []
    if config.gradient_checkpointing:
        leaves = checkpoint_targets(model, registry.leaf_modules(adapter, model.config))
    return _Plans(split, tied, shards_by_rank, sp_plan, leaves)


def validate_layout(
    model: nn.Module, config: ParallelConfig, world_size: int, *, registry: Registry | None = None
) -> ParallelConfig:
    """Run every refusal of ``parallelize`` without a process group; return ``config`` resolved for the world.

    ``model`` may be built on the meta device (``with torch.device("meta")``), so a trainer can refuse a
    bad layout before it initialises torch.distributed or reads a single weight.
    """
    registry = registry or default_registry()
    _plan(model, config, registry, registry.resolve(model.config))
    return config.resolve(world_size)


def parallelize(
    model: nn.Module, config: ParallelConfig, *, registry: Registry | None = None,
    timeout: datetime.timedelta | None = None,
) -> ParallelModel:
    """Lay ``model`` (a transformers causal LM, on CPU, GPU or meta) out over the running world.

    ``timeout`` bounds every collective on the tp/pp/dp groups (see ``Mesh.from_world``).

    Every check that can fail runs before the first collective, so a bad layout is an error on every
    rank, never a hang.
    """
    registry = registry or default_registry()
    adapter = registry.resolve(model.config)
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world_size > 1 else 0
    plans = _plan(model, config, registry, adapter)
    split, tied, shards_by_rank, sp_plan, leaves = (plans.split, plans.tied, plans.shards_by_rank, plans.sp_plan,
                                                    plans.leaves)
    specs_by_rank = [param_specs(model, shards) for shards in shards_by_rank]
    config = config.resolve(world_size)  # after the model checks: they do not depend on the launch

    mesh = Mesh.from_world(config, timeout)
    assert mesh.rank == rank
    stage_ids = stages_of_rank(mesh.pp_rank, config) if split is not None else []
    if split is not None:
        prune(model, split, stage_ids)  # before anything touches weights: other stages' modules are gone
        kept = dict(model.named_parameters(remove_duplicate=False))
        specs_by_rank = [{n: spec for n, spec in specs.items() if n in kept} for specs in specs_by_rank]
    owns = lambda name: not dropped(model, name)  # noqa: E731
    shards = {name: shard for name, shard in shards_by_rank[mesh.tp_rank].items() if owns(name)}
    applied = apply_tensor_parallel(model, shards, mesh, config.sequence_parallel)
    sp_params: list[nn.Parameter] = []
    if sp_plan is not None:
        sp_params = sp_grad_sum_params(model, sp_plan, shards)
        install_sequence_parallel(model, sp_plan, mesh.tp_group, applied.head_is_parallel, owns)
    apply_activation_checkpointing(model, [name for name in leaves if owns(name)])
    if tied:
        mesh.pipeline_ends_group()  # collective: every rank creates the groups, in the same order
    local = dict(model.named_parameters(remove_duplicate=False))
    tied_params = list({id(p): p for names in tied for n in names if (p := local.get(n)) is not None}.values())
    pmodel = ParallelModel(model, mesh, adapter, applied, specs_by_rank, sp_params, tied_params)
    if split is not None:
        seq_shards = config.tp if config.sequence_parallel else 1
        chunks = [StageChunk(model, split, s, seq_shards, applied.entry.clear, pmodel.forward_context)
                  for s in stage_ids]
        pmodel.pipeline = PipelineRunner(chunks, stage_ids, mesh, pmodel.loss)
    return pmodel
