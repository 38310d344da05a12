"""Prompts with images: an image-text model's image inputs reach the prompts' forward, and no decoding step.

transformers' ``generate`` hands ``pixel_values`` (and what describes the images) to the first forward only, where
the model merges the image features into the prompts' image tokens; every later step reads the KV cache. So does
``ParallelModel.generate``: ``PromptImages`` gives a replica's image inputs to its first forward, the processor's
per-token tensors (Gemma 3's ``token_type_ids``) left padded with zeros where that forward's tokens are (sequence
parallelism pads each forward to a multiple of tp), and nothing to the forwards after it.

Served where the training forward takes images: tensor parallelism with or without SP, data parallelism, ZeRO-1/2/3,
context parallelism (each cp rank decodes its replica's rows whole), pipeline stages (each micro-batch's pixels to
the first stage's prompts' forward, its per-token tensors to every stage's, as in training) and expert parallelism,
held to one process for LLaVA, Idefics3, Gemma 3, Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE (tests/test_vlm_generate.py).
A model whose rotary positions follow the images' grids (M-RoPE: Qwen-VL) gets the prompts' positions from its own
``get_rope_index`` (``plait.base.images.grid_position_ids``) and each step's one past the last, as transformers'
keeps them, on every stage; Qwen3-VL's visual tokens added after a decoder layer (deepstack) are cut to each rank's
tokens under SP. Refused in one line before any collective (``check_image_prompts``): grid positions without a
``get_rope_index``, a text model given images, and under ZeRO-2/3 a replica whose prompts hold no image (the vision
tower's shards are gathered by every replica together, so one that skips it would leave the others waiting); under
pp what training refuses (``plait.parallel.deepstack.check_image_stages``: a cut inside deepstack's layers).
``plait generate`` asks the model-only part of these on the meta model before any process group
(``check_positions_decodable``, ``plait.layout_plan.check_planned_image_stages``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.base.config import ConfigError
from plait.base.images import ImageBatch, pipeline_unseen
from plait.base.mesh import Mesh
from plait.base.meta import image_text_model


class PromptImages:
    """A replica's image inputs (the ``rows`` of ``images``), given once: to the first forward that asks. A pipeline
    stage after the first (``first_stage`` False) gets the processor's per-token tensors alone, as in training."""

    def __init__(self, images: ImageBatch | None, rows: slice, first_stage: bool = True) -> None:
        part = None if images is None else images.take(rows)
        self.inputs = {} if part is None else part.inputs() if first_stage else part.later_stage_inputs()
        self.row_major = () if images is None else images.row_major

    def take(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The image inputs for a forward of ``ids`` [rows, tokens] (the first: after it, none)."""
        inputs, self.inputs = self.inputs, {}
        return {name: F.pad(t, (ids.shape[1] - t.shape[1], 0)) if name in self.row_major else t
                for name, t in inputs.items()}


def check_image_prompts(module: nn.Module, mesh: Mesh, batch: int, images: ImageBatch | None) -> None:
    """Refuse, on every rank alike and before any collective, images that generation of ``module`` laid out on
    ``mesh`` would not serve."""
    if images is None:
        return
    name = type(module).__name__.removeprefix("FSDP")  # ZeRO-2/3's subclass of the model's class
    if not image_text_model(module):
        raise ConfigError(f"generation was given images, but {name} is a text model; give the prompts alone")
    if images.rows != batch:
        raise ConfigError(f"generation was given the images of {images.rows} rows for a batch of {batch} prompts; "
                          f"give each prompt's images (none for a text-only prompt)")
    config = mesh.config
    check_positions_decodable(module, images)
    if config.fsdp:
        check_replicas_hold_images(images.per_row.tolist(), batch, mesh.dp, "the batch", f"ZeRO-{config.zero_stage}")


def check_positions_decodable(module: nn.Module, images: ImageBatch | None) -> None:
    """Refuse a model whose positions follow its images' grids where decoding cannot compute them before the
    forward (``pipeline_unseen``; with ``images`` None what the model alone tells: ``plait generate`` asks on the
    meta model before any process group)."""
    unseen = pipeline_unseen(module, images)
    if unseen is not None:
        name = type(module).__name__.removeprefix("FSDP")
        raise ConfigError(f"generation with images is not served for {name}: {unseen} cannot be computed for its "
                          f"decoding steps")


def check_replicas_hold_images(images: list[int], batch_size: int, dp: int, what: str, stage: str) -> None:
    """Under ZeRO-2/3, refuse prompts (``images``: each one's image count, in order) of which a batch of
    ``batch_size`` (the last filled with copies of its last prompt, as ``plait.run.prompts.complete`` fills it) gives
    a data-parallel replica no image: ``ParallelModel.generate`` would refuse it mid-run, after the process group."""
    per = batch_size // dp
    for first in range(0, len(images), batch_size):
        batch = images[first: first + batch_size]
        batch += batch[-1:] * (batch_size - len(batch))
        for replica in range(0, batch_size, per):
            if not any(batch[replica: replica + per]):
                last = first + replica + per - 1
                raise ConfigError(f"{stage}: prompts {first + replica} to {last} of {what} hold no image, and every "
                                  f"replica's prompts of a batch need one (the vision tower's shards are gathered by "
                                  f"every replica together); order the prompts so that each batch of {batch_size} "
                                  f"gives every replica an image, or use ZeRO-1")
