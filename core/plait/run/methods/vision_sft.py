"""Supervised fine-tuning of an image-text-to-text model on TRL's vision format (``--data_format vision``, or auto
where the first .jsonl line has ``images`` beside ``messages``).

Each row is rendered with the model's own processor and chat template (``plait.data.vision``): its image parts
become the model's image tokens, its images the pixel tensors, its labels the assistant text only. A micro-batch is
its rows right padded to the longest (a multiple of tp under sequence parallelism, whose split needs it), with their
images (``plait.base.images.ImageBatch``); the loss is the cross-entropy over the global batch's labelled tokens
divided by their count, as next-token SFT's, so every layout and split gives one process's loss. Layouts: tp (the
vision tower and projector whole on every tp rank), pp (the tower and projector on the first stage, each
micro-batch's images riding with its rows), cp (the image features merged into the whole sequence, each cp rank's
language model on its slice), dp, ZeRO-1/2/3.

Under ZeRO-2/3 FSDP reduces a gradient only where its module ran, so a replica whose micro-batch holds no image
would leave the others waiting on the vision tower's (``ParallelModel`` refuses such a batch). Such a micro-batch
gets a stand-in row: a training row with images, all its labels ignored, which runs the vision tower and adds
exactly nothing to the loss or any gradient (no label reads its logits), the other rows' tokens unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch

from plait.base import comm
from plait.base.config import ConfigError
from plait.base.mesh import Mesh
from plait.base.images import grid_positions
from plait.base.meta import takes_images
from plait.data.pixel_loader import read_ahead
from plait.data.processors import load_processor
from plait.data.vision import Example, VisionBatch, VisionEncoder, collate, pack, read_rows
from plait.parallel_model import ParallelModel
from plait.run.methods.base import TrainingMethod, micro_rows

TOWER = re.compile(r"vision|visual|image_encoder")  # the image encoder's name among the base model's children
PROJECTOR = re.compile(r"projector|connector|merger|aligner")  # what maps its features into the text width


def read_examples(path: str, encoder: VisionEncoder, block_size: int) -> list[Example]:
    """Every row of ``path`` encoded; a row longer than ``block_size`` tokens is refused (cutting it could cut an
    image's tokens from its pixels), and so are rows of which none has a token to train on (no assistant turn, or
    roles the chat template does not take for one: every step trained nothing, at loss 0)."""
    rows = read_rows(path)
    examples = [encoder.encode(row, f"{path} {place}") for place, row in rows]
    if not examples:
        raise ConfigError(f"{path}: no rows in it")
    if not any(labelled(example) for example in examples):
        roles = sorted({str(m.get("role")) for _, row in rows for m in row.get("messages") or []
                        if isinstance(m, dict)})
        raise ConfigError(f"{path}: no row has a token to train on: the labels are the assistant turns' tokens, and "
                          f"its rows' roles are {', '.join(roles)}; give each row an 'assistant' turn")
    for example in examples:
        if len(example.input_ids) > block_size:
            raise ConfigError(f"{example.where}: {len(example.input_ids)} tokens with its images' tokens, more than "
                              f"--block_size {block_size}; raise --block_size or shorten the row")
    return examples


def vision_modules(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The names of an image-text-to-text model's vision towers and projectors: the base model's children named as
    transformers names them (``vision_tower``, ``visual``, ``vision_model``; ``multi_modal_projector``,
    ``connector``), and a projector inside a tower (Qwen-VL's ``visual.merger``)."""
    base = getattr(model, "model", model)
    prefix = "model." if base is not model else ""
    towers = [f"{prefix}{name}" for name, _ in base.named_children() if TOWER.search(name)]
    projectors = [f"{prefix}{name}" for name, _ in base.named_children() if PROJECTOR.search(name)]
    projectors += [f"{tower}.{name}" for tower in towers for name, _ in model.get_submodule(tower).named_children()
                   if PROJECTOR.search(name)]
    return towers, projectors


def freeze_vision(model: torch.nn.Module, tower: bool, projector: bool) -> None:
    """--freeze_vision_tower, --freeze_projector: their parameters take no gradient (a projector inside the tower
    follows its own flag); one line for a model that has none."""
    if not (tower or projector):
        return
    towers, projectors = vision_modules(model)
    flags = [("--freeze_vision_tower", tower, towers), ("--freeze_projector", projector, projectors)]
    for flag, asked, found in flags:
        if asked and not found:
            children = [name for name, _ in getattr(model, "model", model).named_children()]
            what = "is a text model" if not takes_images(model.config) else f"has none among {children}"
            raise ConfigError(f"{flag}: {type(model).__name__} {what}; drop it")
    for name, param in model.named_parameters():
        in_projector = any(name.startswith(f"{p}.") for p in projectors)
        in_tower = not in_projector and any(name.startswith(f"{t}.") for t in towers)
        if (projector and in_projector) or (tower and in_tower):
            param.requires_grad_(False)


def check_packing(model_config: Any) -> None:
    """--packing needs position ids that restart at each document; a model whose rotary positions follow its
    images' grids (Qwen-VL's multimodal RoPE, computed inside from the ids and the grids) gets none: refused."""
    if grid_positions(model_config):
        raise ConfigError(f"--packing with {model_config.model_type}: its multimodal rotary positions are computed "
                          f"from each row's images, not from position ids that restart at each document; drop "
                          f"--packing")


def labelled(example: Example) -> int:
    """The tokens whose next token the loss scores (labels shift by one inside the loss)."""
    return int((example.labels[1:] != -100).sum())


def unlabelled(example: Example, role: str) -> Example:
    """``example`` with every label ignored: it runs the model and adds nothing to a loss or any gradient."""
    return dataclasses.replace(example, labels=torch.full_like(example.labels, -100), where=f"{example.where} ({role})")


class VisionSFT(TrainingMethod):
    """``examples``: the encoded training rows; ``pad_id``: the tokenizer's pad token; ``multiple``: what a
    micro-batch's length is padded to a multiple of (tp under sequence parallelism, times 2 cp under cp)."""

    def __init__(self, examples: list[Example], pad_id: int, multiple: int = 1, stand_in: bool = False,
                 processor: Any = None) -> None:
        self.examples, self.pad_id, self.multiple, self.processor = examples, pad_id, multiple, processor
        self.tokens = 0
        with_images = next((e for e in examples if e.num_images), None) if stand_in else None
        self.stand_in = None if with_images is None else unlabelled(with_images, "stand-in")

    @classmethod
    def load_data(cls, args: Any, model_config: Any, plan: Any) -> tuple[list[Example], list[Example] | None, Any]:
        folder = args.tokenizer_name or args.model_name_or_path
        if folder is None:
            raise ConfigError("--data_format vision needs the model's processor: give --model_name_or_path with one "
                              "(or --tokenizer_name, a directory holding it)")
        args.refuse_unread(("train_on_prompt", "overlong", "text_field"), "image-text rows are chat 'messages' with "
                           "their 'images', trained on their assistant turns, and a row longer than --block_size is "
                           "refused (cutting it could cut an image's tokens)")
        if args.packing:
            check_packing(model_config)
        processor = load_processor(folder)
        train = read_examples(args.train_file, VisionEncoder(processor, Path(args.train_file).parent, lazy=True),
                              args.block_size)
        validation = None
        if args.validation_file:
            encoder = VisionEncoder(processor, Path(args.validation_file).parent, lazy=True)
            validation = read_examples(args.validation_file, encoder, args.block_size)
        if args.packing:
            train = pack(train, args.block_size)
            validation = None if validation is None else pack(validation, args.block_size)
        return train, validation, processor.tokenizer

    @classmethod
    def create(cls, trainer: Any) -> VisionSFT:
        tokenizer, config = trainer.tokenizer, trainer.pmodel.config
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        fsdp, args = trainer.pmodel.fsdp is not None, trainer.args
        return cls(trainer.blocks, pad, config.sequence_multiple, stand_in=fsdp,
                   processor=load_processor(args.tokenizer_name or args.model_name_or_path))

    def __len__(self) -> int:
        return len(self.examples)

    def describe(self, block_size: int) -> str:
        images = sum(example.num_images for example in self.examples)
        return f"{len(self):,} image-text rows with {images:,} images"

    def divisor(self, rows: torch.Tensor) -> int:
        return sum(labelled(self.examples[int(r)]) for r in rows)

    def batch(self, rows: torch.Tensor, device: torch.device) -> VisionBatch:
        """The examples of ``rows`` collated, padded to a multiple of ``multiple`` tokens."""
        examples = [self.examples[int(r)] for r in rows]
        if self.stand_in is not None and not any(e.num_images for e in examples):
            examples.append(self.stand_in)
        batch = collate(examples, self.pad_id)
        extra = -batch.input_ids.shape[1] % self.multiple
        pad = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value).to(device)  # noqa: E731
        images = batch.images.widened(batch.input_ids.shape[1] + extra).to(device)  # per-token extras as the tokens
        positions = None if batch.position_ids is None else pad(batch.position_ids, 0)
        return VisionBatch(pad(batch.input_ids, self.pad_id), pad(batch.attention_mask, 0),
                           pad(batch.labels, -100), images, positions)

    def micro_batches(self, rows: torch.Tensor, mesh: Mesh, accumulation: int, device: torch.device) -> list[Any]:
        self.tokens = sum(len(self.examples[int(r)].input_ids) for r in rows)  # the global batch's, unpadded
        return [self.batch(micro, device) for micro in micro_rows(rows, mesh, accumulation)]

    def read_ahead(self, step: int, rows: torch.Tensor, mesh: Mesh, accumulation: int) -> None:
        read_ahead(self.examples[int(r)] for micro in micro_rows(rows, mesh, accumulation) for r in micro)

    def micro_step(self, pmodel: ParallelModel, batch: VisionBatch, divisor: int) -> torch.Tensor:
        # packed rows: the documents kept apart by their position ids (transformers reads them without a mask)
        mask = batch.attention_mask if batch.position_ids is None else None
        return pmodel.train_step(batch.input_ids, batch.labels, mask, num_items_in_batch=divisor,
                                 position_ids=batch.position_ids, images=batch.images)

    def step_tokens(self) -> int:
        return self.tokens

    @torch.no_grad()
    def evaluate(self, pmodel: ParallelModel, data: list[Example], batch_size: int,
                 device: torch.device) -> dict[str, float]:
        """Mean loss and perplexity over every validation row, split over dp ranks: one process's whatever the
        layout. Every dp rank runs as many whole pipeline microbatches (a ZeRO-3 or tp forward is collective), so
        the rows are padded to a multiple of dp x microbatches with the last row repeated, its labels ignored: its
        inputs real ones (under ZeRO-2/3 a micro-batch without images gets the stand-in row, as in training), the
        loss divided by the real rows' labelled tokens (the rows were once cut to that multiple instead: an odd
        count evaluated one row less at dp=2)."""
        mesh, m = pmodel.mesh, pmodel.config.num_microbatches
        padded = -(-len(data) // (mesh.dp * m)) * (mesh.dp * m)
        mine = torch.arange(padded)[mesh.dp_rank::mesh.dp].clamp(max=len(data))  # len(data): the padding row
        evaluator = VisionSFT([*data, unlabelled(data[-1], "padding")], self.pad_id, self.multiple,
                              stand_in=self.stand_in is not None)
        count = max(evaluator.divisor(torch.arange(len(data))), 1)
        batch_size = max(batch_size // m * m, m)
        total = torch.zeros((), device=device)
        pmodel.eval()
        for start in range(0, len(mine), batch_size):
            batch = evaluator.batch(mine[start:start + batch_size], device)
            mask = batch.attention_mask if batch.position_ids is None else None
            total += pmodel.eval_loss(batch.input_ids, batch.labels, mask, num_items_in_batch=count,
                                      position_ids=batch.position_ids, images=batch.images)
        pmodel.train()
        loss = comm.all_reduce(total, mesh.replica_group).item()  # dp ranks' rows, cp ranks' tokens
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
