"""Running a step through ``torch.distributed.pipelining`` schedules (docs/decisions.md D3).

Schedules by name (the table is ``plait.base.pipeline_schedules``): gpipe and 1f1b run one stage per rank;
interleaved-1f1b and zero-bubble (ZB1P, with the backward split into input and weight passes) run
``virtual_pipeline_size`` looped stages per rank (rank r holds stages r, r + pp, ...). Losses are sums over
tokens divided by the global token count, so the schedule must not rescale gradients (``scale_grads=False``)
and the step's loss is the sum over microbatches, broadcast from the last stage to the whole pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.base import comm
from plait.base.images import ImageBatch
from plait.base.config import ConfigError, ParallelConfig
from plait.base.mesh import Mesh
from plait.base.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULES, microbatch_refusal
from plait.base.words import setting
from plait.tp.logprobs import Objective, read_logits

LossFn = Callable[[torch.Tensor, torch.Tensor, "int | torch.Tensor"], torch.Tensor]


def check_schedule(config: ParallelConfig) -> None:
    """Refuse, naming the numbers, a schedule that cannot run ``config`` (before any collective)."""
    name, pp, v, m = config.pipeline_schedule, config.pp, config.virtual_pipeline_size, config.num_microbatches
    multi_stage = SCHEDULES[name].multi_stage
    if not multi_stage and v > 1:
        raise ConfigError(
            f"{setting('pipeline_schedule', name)} runs one stage per rank but {setting('virtual_pipeline_size', v)}; "
            f"use {setting('pipeline_schedule', 'interleaved-1f1b')} or {setting('pipeline_schedule', 'zero-bubble')} "
            f"for virtual stages, or {setting('virtual_pipeline_size', 1)}"
        )
    if v < SCHEDULES[name].min_virtual:
        least = SCHEDULES[name].min_virtual
        raise ConfigError(
            f"{setting('pipeline_schedule', name)} needs {setting('virtual_pipeline_size')} >= {least} (got {v}); "
            f"give {setting('virtual_pipeline_size', least)} or {setting('pipeline_schedule', DEFAULT_SCHEDULE)}"
        )
    refusal = microbatch_refusal(name, pp, m)
    if refusal:
        raise ConfigError(refusal)


class PipelineRunner:
    """This rank's stages (``chunks``, stage ids ``stage_ids``) and the schedules that drive them.

    A schedule is built per batch shape (its stages learn tensor shapes from the first microbatch) and
    reused by later steps of that shape.
    """

    def __init__(self, chunks: list[nn.Module], stage_ids: list[int], mesh: Mesh, loss_fn: LossFn,
                 token_ids: bool = False, aux_divisor: int = 1) -> None:
        self.chunks, self.stage_ids, self.mesh, self.loss_fn = chunks, stage_ids, mesh, loss_fn
        # what each microbatch's aux term is divided by (plait.parallel.moe_balance.aux_divisor; the ParallelModel sets it
        # again when set_global_batch names how many train_step calls make a step)
        self.aux_divisor = aux_divisor
        self.token_ids = token_ids  # every stage gets the input ids (``PipelinePlan.token_ids``)
        self.config = mesh.config
        self.num_stages = mesh.pp * self.config.virtual_pipeline_size
        self._schedules: dict[tuple, object] = {}
        self._num_items: int | torch.Tensor = 1
        self._objective: Objective | None = None  # a training method's loss for this run (ParallelModel.train_step)
        # the step loss: fp32 at least, float64 for a float64 model; the same on every stage, for the broadcast
        param = next((p for chunk in chunks for p in chunk.parameters()), None)
        self.loss_dtype = torch.float32 if param is None else torch.promote_types(torch.float32, param.dtype)

    def _schedule(self, key: tuple, device: torch.device):
        if key not in self._schedules:
            from torch.distributed import pipelining

            stage_class = _shapes_marked(pipelining.PipelineStage)
            stages = [
                stage_class(chunk, stage, self.num_stages, device, group=self.mesh.pp_group)
                for chunk, stage in zip(self.chunks, self.stage_ids)
            ]
            name = self.config.pipeline_schedule
            m, kind = self.config.num_microbatches, SCHEDULES[name]
            schedule_class = getattr(pipelining, kind.torch_class)
            schedule = schedule_class(stages if kind.multi_stage else stages[0], m, loss_fn=self._loss,
                                      scale_grads=False)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """One microbatch's loss from the last stage's output: its logits, or its logits and the router's aux
        term (coef x aux, plait.pipeline.router), which plait averages over a step's forwards (every dp and cp
        rank's microbatches) as ``ParallelModel`` does at pp=1: the gradient sums over them make it exact. Under
        the global-batch scope the terms already sum to the step's loss, and only cp divides them."""
        logits, aux = output if isinstance(output, tuple) else (output, None)
        if self._objective is not None:  # labels carry each row's index in the batch as a last column (run)
            loss = self._objective(read_logits(logits, labels[:, :-1], labels[:, -1], self.loss_fn, self.mesh))
        else:
            loss = self.loss_fn(logits, labels, self._num_items)
        return loss if aux is None else loss + aux / self.aux_divisor

    def run(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
        num_items_in_batch: int | torch.Tensor, train: bool, position_ids: torch.Tensor | None = None,
        objective: Objective | None = None, images: ImageBatch | None = None,
    ) -> torch.Tensor:
        """Forward (and backward when ``train``) of every microbatch; the summed loss, on every pp rank.
        The attention mask and position ids go to every stage (each rebuilds the causal mask), and the input
        ids too where the plan asks for them (every rank of the pipeline reads the same batch). With an
        ``objective`` the last stage computes it instead of the cross-entropy; the schedule splits the target into
        microbatches, so each row's index in the batch rides along as the target's last column. ``images`` (an
        image-text model's) ride along by row (``ImageBatch.by_row``), for the first stage's vision tower."""
        key = (tuple(input_ids.shape), attention_mask is not None, position_ids is not None, train, images is not None)
        schedule = self._schedule(key, input_ids.device)
        self._num_items, self._objective = num_items_in_batch, objective
        if objective is not None:
            rows = torch.arange(labels.shape[0], device=labels.device)
            labels = torch.cat([labels, rows[:, None]], dim=1)
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self.token_ids:
            kwargs["token_ids"] = input_ids
        if images is not None:
            kwargs["images"] = images.by_row()
        losses: list[torch.Tensor] = []
        if train:
            schedule.step(input_ids, target=labels, losses=losses, return_outputs=False, **kwargs)
        else:
            with torch.no_grad():
                schedule.eval(input_ids, target=labels, losses=losses, return_outputs=False, **kwargs)
        if losses:
            total = torch.stack([loss.detach().to(self.loss_dtype) for loss in losses]).sum()
        else:
            total = torch.zeros((), dtype=self.loss_dtype, device=input_ids.device)
        return comm.broadcast(total, self.mesh.pp_group, src=self.mesh.pp - 1)


def _shapes_marked(stage_class: type) -> type:
    """``stage_class`` (torch's PipelineStage) telling its chunk when it runs a forward only to learn the shapes of
    what stages send each other (torch's metadata inference, on received tensors left uninitialised): the chunk
    then zero-fills the integer values carried between layers (top-k indices), whose garbage would index out of
    bounds. Torch versions without that method never call the override."""

    class ShapesMarked(stage_class):
        def _forward_metadata_inference(self, *args, **kwargs):
            self.submod.shapes_only = True
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                self.submod.shapes_only = False

    return ShapesMarked
