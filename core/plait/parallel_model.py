"""``ParallelModel``: a transformers causal LM laid out over a mesh, as ``plait.parallelize`` returns it.

One object drives every layout the same way: ``train_step`` (forward and backward of a step's local batch, through
the pipeline schedule when pp > 1), ``eval_loss``, ``forward`` (pp=1), ``generate`` (decoding from its own shards)
and ``grad_sync``. It is built by ``plait.parallelize._apply`` from the pieces each mechanism applied, and holds
them; nothing is patched into it afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from plait.base import comm
from plait.base.batches import check_batch_shapes, local_microbatch
from plait.base.config import ConfigError, ParallelConfig
from plait.base.images import (ImageBatch, grid_position_ids, grid_positions, image_layouts_besides,
                               images_attend_both_ways)
from plait.base.mesh import Mesh
from plait.base.words import setting
from plait.cp.attention import whole_sequences
from plait.cp.context import ContextParallel
from plait.cp.images import text_model_takes_its_tokens
from plait.cp.sequence import check_length
from plait.ep.apply import AppliedEP
from plait.generation.decode import Criteria, StageCache, check_batch, decode, drop_pads
from plait.generation.images import PromptImages, check_image_prompts
from plait.generation.pipelined import decode_stages
from plait.layout_plan import LayoutPlan
from plait.parallel.compile import compile_leaf_modules
from plait.parallel.deepstack import check_image_stages, check_pipeline as check_deepstack_stage, \
    deepstack_on_local_tokens
from plait.parallel.float8 import check_float8_tokens
from plait.parallel.fsdp import AppliedFSDP, reshard
from plait.parallel.grad_sync import GradSync
from plait.parallel.moe_balance import GlobalBalance, aux_divisor
from plait.parallel.step_loss import StepLoss, step_loss
from plait.pipeline.runner import PipelineRunner
from plait.plugin.registry import Adapter
from plait.tp.apply import AppliedTP
from plait.tp.logprobs import Objective, read_logits
from plait.tp.loss import CausalLMLoss, num_items_in_batch as count_label_tokens
from plait.tp.sharding import ShardSpec


def precision_context(config: ParallelConfig, module: nn.Module) -> contextlib.AbstractContextManager:
    """torch.autocast(bfloat16) around a forward pass when the config asks for it, on the parameters' device
    type (looked up at call time: a model laid out on the meta device is materialised later)."""
    if not config.bf16_autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(module.parameters()).device.type, dtype=torch.bfloat16)

T = TypeVar("T", torch.Tensor, ImageBatch)


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

    def local_batch(self, tensor: T, accumulation_steps: int = 1, micro_step: int = 0) -> T:
        """This rank's rows of a global batch ``tensor`` (ids, labels, mask or positions, or an ``ImageBatch``) for
        ``train_step`` or ``eval_loss``: its dp replica's contiguous slice (of micro-step ``micro_step`` of
        ``accumulation_steps``); the tp, cp and pp ranks of a replica pass the same rows (cp ranks take their tokens
        inside)."""
        count = tensor.rows if isinstance(tensor, ImageBatch) else tensor.shape[0]
        rows = local_microbatch(torch.arange(count), self.mesh.dp_rank, self.mesh.dp, accumulation_steps, micro_step)
        if isinstance(tensor, ImageBatch):
            return tensor.take(slice(int(rows[0]), int(rows[-1]) + 1))
        return tensor[rows.to(tensor.device)]

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss from this rank's share (what ``train_step`` and ``eval_loss`` return when given
        the global ``num_items_in_batch``): the sum over the ranks that split the batch (dp x cp), equal on every
        rank. A collective: every rank calls it."""
        whole = comm.all_reduce(loss.detach().clone(), self.mesh.replica_group)
        return step_loss(whole) if isinstance(loss, StepLoss) else whole  # train_step's: backward() says it ran

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        images: ImageBatch | None = None,
    ) -> torch.Tensor:
        """Loss when ``labels`` are given (causal shift inside), else this rank's vocab slice of the logits.
        ``images``: an image-text-to-text model's image inputs of these rows.

        Under cp the logits are this rank's tokens' (``self.cp.take`` picks the matching slice of a whole
        tensor) and the loss is this rank's share: summed over the cp group it is the whole batch's."""
        if self.pipeline is not None:
            raise ConfigError(
                f"forward() runs the whole model, but pp={self.mesh.pp} spreads it over ranks; call "
                f"train_step() or eval_loss(), which run the pipeline schedule"
            )
        self._check_sequence(input_ids, attention_mask, images=images, labels=labels)
        if self.cp is not None and labels is not None and num_items_in_batch is None:  # whole sequences' count
            num_items_in_batch = count_label_tokens(labels).clamp(min=1)
        if self.balance is not None and labels is not None:  # its own batch's balance, a step's left as it was
            with self.balance.kept():
                self._routing_pass([(input_ids, attention_mask, position_ids)], one_forward=True)
                return self._forward(input_ids, labels, attention_mask, num_items_in_batch, position_ids)
        return self._forward(input_ids, labels, attention_mask, num_items_in_batch, position_ids, images=images)

    def _forward(self, input_ids, labels, attention_mask, num_items_in_batch, position_ids=None, objective=None,
                 rows=None, images: ImageBatch | None = None) -> torch.Tensor:
        pictures = {} if images is None else images.inputs()
        sp = self.mesh.tp_group if self.config.sequence_parallel else None
        with deepstack_on_local_tokens(self.module, self.cp and self.cp.take, sp) if pictures else \
                contextlib.nullcontext():
            out = self._forward_model(input_ids, attention_mask, position_ids, images, pictures)
        if labels is None:
            return out.logits
        if self.cp is not None:
            labels = self.cp.shard_labels(labels)
        if objective is not None:  # a training method's own loss from the logits (plait.tp.logprobs)
            loss = objective(read_logits(out.logits, labels, rows, self.loss, self.mesh))
        else:
            loss = self.loss(out.logits, labels, num_items_in_batch)
        if self.balance is not None:  # the global batch's load balancing, this forward's part (moe_balance)
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

    def _forward_model(self, input_ids, attention_mask, position_ids, images, pictures) -> Any:
        """The model's output for this rank's tokens: under cp with the whole sequence's positions and mask at hand,
        an image-text model's features merged into the whole sequence and its text model on this rank's slice."""
        if self.cp is None:
            return self._model(input_ids, attention_mask, position_ids, **pictures)
        with self.cp.forward(*input_ids.shape, attention_mask, position_ids, input_ids.device) as local:
            if not pictures:
                return self._model(self.cp.take(input_ids), local.get("attention_mask"), local["position_ids"])
            grid = grid_position_ids(self.module, input_ids, attention_mask, images)
            with text_model_takes_its_tokens(self.module, self.cp, grid):
                return self._model(input_ids, local.get("attention_mask"), local["position_ids"], **pictures)

    def _model(self, input_ids, attention_mask, position_ids, **extra) -> Any:
        extra = {"use_cache": False, **extra} | ({} if position_ids is None else {"position_ids": position_ids})
        try:  # extra: the KV cache and use_cache (plait.generation), or image inputs
            with precision_context(self.config, self.module):
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
        images: ImageBatch | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one optimizer step's local batch, split into ``num_microbatches``;
        gradients accumulate into ``.grad``. Returns the loss (summed over microbatches: the step's loss
        when ``num_items_in_batch`` is the global token count) on every rank of the pipeline, detached: its
        ``backward()`` refuses, naming the optimizer step as the next call (``plait.parallel.step_loss``).

        ``num_items_in_batch``: tokens with a label in the global batch (all dp ranks); None counts this
        rank's batch, right only for dp=1. Sum gradients afterwards (``OptimizerStep`` or ``grad_sync.finish()``).
        ``position_ids`` ([batch, seq], whole sequences): restarting at 0 inside a row marks packed documents,
        which transformers' mask then keeps apart (block-diagonal attention, on every pipeline stage).
        ``objective``: a training method's loss instead of the cross-entropy (DPO's, ...): called with each
        microbatch's logits on the ranks that compute the loss (the last pipeline stage), it returns this rank's
        share of the step's loss (``plait.tp.logprobs``); ``num_items_in_batch`` is then unused.
        ``images``: an image-text-to-text model's image inputs of these rows (``plait.base.images``), cut with them.
        """
        if self.balance is not None:
            self._balance_for(input_ids, attention_mask, position_ids)
        self.grad_sync.pending.gradients_written()  # a plain optimizer.step() before the sums is refused
        return step_loss(self._run(input_ids, labels, attention_mask, num_items_in_batch, position_ids, train=True,
                                   objective=objective, images=images))

    def set_global_batch(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
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
        images: ImageBatch | None = None,
    ) -> torch.Tensor:
        """``train_step`` without backward (validation loss, or an ``objective``'s), on every rank of the pipeline."""
        with torch.no_grad(), contextlib.ExitStack() as stack:
            stack.callback(reshard, self.fsdp)  # ZeRO-2/3: no backward follows to reshard what it gathered
            if self.balance is not None:  # its own batch's balance, leaving a training step's as it was
                stack.enter_context(self.balance.kept())
                self._routing_pass([(input_ids, attention_mask, position_ids)])
            return self._run(input_ids, labels, attention_mask, num_items_in_batch, position_ids, train=False,
                             objective=objective, images=images)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from every tp rank's slice of a vocab-parallel head (padding never shows) or the
        whole head's, detached in every layout (to read: a loss goes through train_step). A collective when split."""
        applied, local_logits = self.applied, local_logits.detach()
        if not applied.head_is_parallel:
            return local_logits
        padded = torch.nn.functional.pad(local_logits, (0, applied.vocab_per_rank - local_logits.shape[-1]))
        # Real vocab rows are contiguous from 0 across ranks and padding sits at the end, so concatenating the
        # padded slices and cutting at the vocab size gives the full logits.
        return comm.all_gather(padded, self.mesh.tp_group, dim=-1)[..., : applied.vocab_size]

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, pad_token_id: int = 0,
        eos_token_id: int | Sequence[int] | None = None, stopping_criteria: Criteria | None = None,
        images: ImageBatch | None = None,
    ) -> torch.Tensor:
        """Completions of prompts from this model's own shards (plait.generation.decode): ``input_ids`` [batch, length]
        is the global batch, the same on every rank, left padded where ``attention_mask`` has zeros; returns [batch,
        length + new] on every rank, padded with ``pad_token_id`` after a row's end (an EOS, or transformers'
        ``stopping_criteria``: a stop string's StopStringCriteria). Temperature 0 is greedy (transformers' ``generate``
        on one process, token for token); sampling (``top_k``, ``top_p``) from ``seed`` gives the same tokens in every
        layout. Every rank calls it (a collective). ``images``: an image-text model's image inputs of these rows
        (``plait.base.images``), read by the prompts' forward (plait.generation.images)."""
        check_batch(self.mesh, input_ids.shape[0])
        check_image_prompts(self.module, self.mesh, input_ids.shape[0], images)  # pipeline_unseen's too
        if images is not None and self.pipeline is not None:
            self._check_deepstack_stages()
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        per = input_ids.shape[0] // self.mesh.dp
        rows = slice(self.mesh.dp_rank * per, (self.mesh.dp_rank + 1) * per)
        mine = None if images is None else images.take(rows)  # this replica's rows' images
        # the head on the last position only, as transformers' generate asks (a prompt's other positions need no
        # logits: 32 of them cost a tenth of a 125M model's decoding), where the forward takes the argument; the
        # cache under the name the forward takes: ``cache`` (transformers 5.24, which warns at the older name) or
        # ``past_key_values``
        arguments = inspect.signature(type(self.module).forward).parameters
        last = {"logits_to_keep": 1} if "logits_to_keep" in arguments else {}
        cache_name = "cache" if "cache" in arguments else "past_key_values"
        cache, prompts = StageCache(), PromptImages(mine, slice(None))

        def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, pads: int) -> torch.Tensor:
            keep, pictures = {"logits_to_keep": pads + 1} if last else {}, prompts.take(ids)
            sp = self.mesh.tp_group if self.config.sequence_parallel else None  # deepstack's visual tokens cut
            with deepstack_on_local_tokens(self.module, None, sp) if pictures else contextlib.nullcontext():
                out = self._model(ids, mask, positions, use_cache=True, **{cache_name: cache}, **keep, **pictures)
            return self.gather_logits(drop_pads(out.logits, cache, pads))

        def all_done(mine: bool, groups: tuple = (comm.world_group(),)) -> bool:
            left = torch.tensor([0 if mine else 1])
            for group in groups:
                comm.all_reduce(left, group)
            return left.item() == 0

        settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_token_id=eos_token_id, pad_token_id=pad_token_id, stopping_criteria=stopping_criteria,
                        width=self.mesh.tp if self.config.sequence_parallel else 1)

        training = self.module.training
        self.module.eval()  # no dropout; the model's own mode given back after
        # under cp each cp rank decodes its replica's rows whole, with the model's own attention (not split)
        whole = contextlib.nullcontext() if self.cp is None else whole_sequences(self.module, self.cp.implementation)
        try:
            with torch.no_grad(), whole:
                grid = None if mine is None else grid_position_ids(self.module, input_ids[rows], attention_mask[rows],
                                                                   mine)
                if self.pipeline is None:  # grid: M-RoPE's positions from the model's get_rope_index (None: counted)
                    ids = decode(forward, input_ids[rows], attention_mask[rows], rows, input_ids.shape[0],
                                 all_done=all_done, position_ids=grid, **settings)
                else:  # the last stages of the replicas agree when every row is done
                    done = functools.partial(all_done, groups=(self.mesh.dp_group, self.mesh.cp_group))
                    ids = decode_stages(self.pipeline.chunks, self.mesh, self.module, self.gather_logits,
                                        input_ids[rows], attention_mask[rows], rows, input_ids.shape[0],
                                        {"use_cache": True, **last}, cache_name, all_done=done, position_ids=grid,
                                        images=mine, **settings)
        finally:
            self.module.train(training)
            reshard(self.fsdp)  # ZeRO-2/3, as eval_loss does
        return comm.all_gather(ids, self.mesh.dp_group, dim=0)

    def _check_sequence(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, microbatches: int = 1,
        train: bool | None = None, images: ImageBatch | None = None, labels: torch.Tensor | None = None,
    ) -> None:
        check_batch_shapes(input_ids, self.plan.model_config.get_text_config().vocab_size, labels=labels,
                           attention_mask=attention_mask)
        if images is not None and self.pipeline is not None:
            self._check_stage_images(images)
        if images is not None and self.cp is not None:
            self._check_images_under_cp(images)
        if images is not None and images.rows != input_ids.shape[0]:
            raise ConfigError(f"the image inputs are of {images.rows} rows, the input_ids of {input_ids.shape[0]}; "
                              f"pass the images of the same rows (ImageBatch.take, ParallelModel.local_batch)")
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
                f"sequence length {seq} is not divisible by {setting('tp', self.mesh.tp)} under sequence "
                f"parallelism; use a block size that is a multiple of {self.mesh.tp}, or {setting('sp', False)}"
            )

    def _run(self, input_ids, labels, attention_mask, num_items_in_batch, position_ids, train: bool,
             objective: Objective | None = None, images: ImageBatch | None = None) -> torch.Tensor:
        """Checks first (identical on every rank, so a refusal never leaves a peer inside a collective)."""
        m = self.config.num_microbatches
        self._check_sequence(input_ids, attention_mask, m, train, images, labels)
        if input_ids.shape[0] % m:
            raise ConfigError(
                f"a local batch of {input_ids.shape[0]} sequences is not divisible by num_microbatches={m}; "
                f"use a per-rank batch that is a multiple of {m}"
            )
        if num_items_in_batch is None:
            num_items_in_batch = count_label_tokens(labels).clamp(min=1)
        pictures = images.chunk(m) if images is not None else [None] * m
        if images is not None and self.fsdp is not None:
            self._check_images_everywhere(pictures)
        if self.pipeline is not None:
            if self.cp is not None:  # stages get this rank's tokens and the whole positions (StageChunk)
                if position_ids is None:
                    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
                input_ids, labels = self.cp.take(input_ids), self.cp.shard_labels(labels)
            elif position_ids is None and images is not None:  # M-RoPE: every stage gets the first one's positions
                grid = grid_position_ids(self.module, input_ids, attention_mask, images)
                position_ids = None if grid is None else grid.transpose(0, 1)  # rows first: the schedule cuts them
            return self.pipeline.run(input_ids, labels, attention_mask, num_items_in_batch, train, position_ids,
                                     objective, images)
        total = None  # in the loss's own dtype: fp32 at least, float64 for a float64 model
        masks = attention_mask.chunk(m) if attention_mask is not None else [None] * m
        positions = position_ids.chunk(m) if position_ids is not None else [None] * m
        rows = [None] * m  # each microbatch's rows in the batch: what an objective reads them by
        if objective is not None:
            rows = torch.arange(input_ids.shape[0], device=input_ids.device).chunk(m)
        for i, (ids, labs, mask, pos) in enumerate(zip(input_ids.chunk(m), labels.chunk(m), masks, positions)):
            loss = self._forward(ids, labs, mask, num_items_in_batch, pos, objective, rows[i], pictures[i])
            if train:
                if self.fsdp is not None:
                    self.fsdp.keep_gathered(i < m - 1)
                loss.backward()
            total = loss.detach().clone() if total is None else total + loss.detach()
        return total

    def _check_stage_images(self, images: ImageBatch) -> None:
        """Under pp, what the stages after the first would not get of an image-text model's inputs."""
        split, sliced = self.plan.split, self.config.sequence_parallel or self.cp is not None
        check_image_stages(self.module, split.layers, split.bounds[0][1] - split.bounds[0][0], self.mesh.pp, sliced,
                           images)

    def _check_deepstack_stages(self) -> None:
        """Under pp, a first stage that does not hold every layer deepstack's visual tokens are added after."""
        split = self.plan.split
        check_deepstack_stage(self.module, split.layers, split.bounds[0][1] - split.bounds[0][0],
                              self.config.sequence_parallel or self.cp is not None)

    def _check_images_under_cp(self, images: ImageBatch) -> None:
        name = type(self.module).__name__
        both_ways = images_attend_both_ways(self.module.config, images)
        if both_ways:
            raise ConfigError(f"image inputs under cp={self.mesh.cp}: {name}'s image tokens attend to each other both "
                              f"ways ({both_ways}), which context parallelism's causal split does not; use "
                              f"{image_layouts_besides(self.module.config, 'cp')} for it")
        if self.pipeline is not None and grid_positions(self.module.config):
            raise ConfigError(f"image inputs under pp={self.mesh.pp} and cp={self.mesh.cp} together: {name}'s "
                              f"multimodal rotary positions are handed to a pipeline's stages or cut for cp, not both; "
                              f"use pp or cp")

    def _check_images_everywhere(self, pictures: list[ImageBatch]) -> None:
        """Under ZeRO-2/3 every micro-batch of every replica must hold an image: FSDP reduces a gradient only where
        its module ran, so a vision tower idle on one replica would leave the others waiting. A collective (each
        rank's image counts), so every rank raises together."""
        counts = comm.all_gather(torch.tensor([[int(p.per_row.sum()) for p in pictures]]), self.mesh.replica_group, 0)
        empty = (counts == 0).nonzero()
        if len(empty):
            replica, micro = empty[0].tolist()
            raise ConfigError(f"under ZeRO-{self.config.zero_stage} every micro-batch needs an image (FSDP reduces the "
                              f"vision tower's gradients only where it ran), but micro-batch {micro} of replica "
                              f"{replica} has none; mix the image rows over the batch, or use ZeRO-1")


def local_specs(model: nn.Module, plan: LayoutPlan, mesh: Mesh, fsdp: AppliedFSDP | None) -> dict[str, ShardSpec]:
    """The shard spec of every parameter ``model`` holds on this rank: its tp shard, its experts under ep, its
    rows under ZeRO-2/3."""
    local = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    specs = plan.specs_by_rank[mesh.tp_rank]
    if plan.ep is not None:
        specs = plan.ep.localize(specs, mesh.ep_rank)
    return {name: fsdp.rows(name, spec) if fsdp is not None else spec for name, spec in specs.items() if name in local}
