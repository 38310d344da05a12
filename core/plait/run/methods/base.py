"""What a training method is to the trainer: its batches, its loss's divisor and its micro-step.

The one ``Trainer`` (``plait.run.trainer``) runs any method on any layout. Each optimizer step it samples the
global batch's rows (every rank knows all of them), asks the method for the loss's divisor over that whole batch
and for this rank's micro-batches, runs the method's micro-step on each (forward and backward through the
``ParallelModel``, which owns every layout's mechanics) and steps the optimizer, so that a method never sees a
process group, a pipeline schedule or a shard, and the trainer holds no branch per method. What a method owns:
its data format (the batches it makes from the rows), its extra models (a reference or a teacher, laid out on the
same mesh by the method) and its loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from plait.base.batches import local_microbatch
from plait.base.mesh import Mesh
from plait.parallel_model import ParallelModel

if TYPE_CHECKING:
    from plait.run.methods.frozen import SecondModel


def micro_rows(rows: torch.Tensor, mesh: Mesh, accumulation: int) -> list[torch.Tensor]:
    """This rank's rows of the global batch ``rows``, one tensor per micro-step (``local_microbatch``)."""
    return [local_microbatch(rows, mesh.dp_rank, mesh.dp, accumulation, micro) for micro in range(accumulation)]


class TrainingMethod(ABC):
    """One training method over a dataset of ``len(self)`` examples (the sampler draws rows from them).
    ``processor``: an image-text model's processor, which a checkpoint saves (``preprocessor``); None for text."""

    processor: Any = None

    @classmethod
    def load_data(cls, args: Any, model_config: Any, plan: Any) -> tuple[Any, Any, Any] | None:
        """(training data, validation data or None, tokenizer) from the run's flags, read before any process group
        exists (a bad file fails every rank alike); None: the trainer's next-token data (token or SFT blocks)."""
        return None

    @classmethod
    def create(cls, trainer: Any) -> "TrainingMethod":
        """The method for a ``Trainer`` that has loaded its data and laid out its model (``trainer.blocks``: what
        ``load_data`` read; ``trainer.spans``: this cp rank's token ranges of a block, None without cp)."""
        return cls(trainer.blocks, trainer.spans)

    @classmethod
    def second_model(cls, args: Any, model: Any, dtype: torch.dtype) -> "SecondModel | None":
        """The frozen second model a run with ``args`` lays out beside the trained ``model`` (both on the meta device,
        in ``dtype``), for ``plait plan`` to count; default: none."""
        return None

    @abstractmethod
    def __len__(self) -> int:
        """The number of training examples."""

    @abstractmethod
    def divisor(self, rows: torch.Tensor) -> int:
        """The loss's divisor for the global batch of ``rows``, the same on every rank (next-token: its labelled
        tokens); 0 means the step has nothing to train on and is skipped."""

    @abstractmethod
    def micro_batches(self, rows: torch.Tensor, mesh: Mesh, accumulation: int, device: torch.device) -> list[Any]:
        """This rank's ``accumulation`` micro-batches of the global batch ``rows``, on ``device``."""

    @abstractmethod
    def micro_step(self, pmodel: ParallelModel, batch: Any, divisor: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns this rank's share of the step's loss (summed over
        the micro-steps and the data-parallel ranks, the step's loss)."""

    def describe(self, block_size: int) -> str:
        """What the run's start line says of the training examples."""
        return f"{len(self):,} blocks of {block_size} tokens"

    def rows_per_step(self, global_batch: int) -> int:
        """The examples the sampler draws for a step of ``global_batch`` rows (GRPO: one prompt per group of
        completions); default: one per row."""
        return global_batch

    def sampler_step(self, step: int) -> int:
        """The sampler's step whose examples optimizer step ``step`` trains on (GRPO: one batch of prompts for the
        --num_iterations steps that reuse its rollouts); default: its own."""
        return step

    def resumable_after(self, steps: int) -> bool:
        """Whether a checkpoint after ``steps`` optimizer steps resumes exactly (GRPO: not inside a cycle of
        iterations, whose rollouts no checkpoint holds); a stop signal waits for one; default: always."""
        return True

    def before_step(self, pmodel: ParallelModel, batches: list[Any], step: int) -> None:
        """Called once a step (``step`` counts from 0), before its micro-steps, with all of them (default: nothing)."""

    def read_ahead(self, step: int, rows: torch.Tensor, mesh: Mesh, accumulation: int) -> None:
        """Start reading what step ``step`` of the global batch ``rows`` will need from disk on this rank, called
        while the step before it computes (image-text methods: their rows' pixels, ``plait.data.pixel_loader``);
        default: nothing. Only reads: no collective, nothing a step sees changes."""

    def step_metrics(self, pmodel: ParallelModel) -> dict[str, float]:
        """The method's own metrics of the step just run, the same on every rank (every rank calls it: it may be a
        collective); default: none."""
        return {}

    @abstractmethod
    def evaluate(self, pmodel: ParallelModel, data: Any, batch_size: int, device: torch.device) -> dict[str, float]:
        """Metrics over the validation data (what ``load_data`` read beside the training data), the same on every
        rank (every rank calls it: it holds collectives); ``batch_size``: examples per dp rank and forward."""

    def preprocessor(self, tokenizer: Any) -> Any:
        """What a checkpoint saves beside the weights for ``plait consolidate`` to ship (its ``save_pretrained``):
        the run's tokenizer, or an image-text model's whole processor (its image processor and template too, which
        ``plait generate`` and ``AutoProcessor`` read from the consolidated directory)."""
        return self.processor or tokenizer

    def step_tokens(self) -> int | None:
        """The tokens the step just run put through the model (its throughput's numerator), once ``step_metrics``
        has run; None: the global batch's blocks x --block_size."""
        return None
