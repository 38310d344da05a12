"""The image inputs of a batch of image-text rows, cut by rows as the token ids are.

An image-text-to-text model's processor returns, beside the token ids, tensors of the batch's images: the pixel
values and what describes them (image sizes, pixel masks, patch grids). Their first dimension counts images (LLaVA,
Idefics3, Gemma 3: ``pixel_values`` [images, channels, height, width]) or, where the processor flattens each image
into patches (Qwen-VL: ``pixel_values`` [patches, dim] beside ``image_grid_thw`` [images, 3]), patches. A row holds
its images in order and the rows' images follow one another, so a contiguous range of rows holds a contiguous range
of images: cutting a batch into dp replicas' rows and micro-batches only needs each row's image count (and each
image's patch count, for the tensors that count patches).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from plait.base.config import ConfigError


@dataclass(frozen=True)
class ImageBatch:
    """``tensors``: the model's image inputs by argument name (``pixel_values``, ...), the rows' images one after
    another; ``per_row`` [rows]: each row's image count; ``patches`` [images]: each image's length in the tensors
    whose first dimension counts patches (None: every tensor counts images); ``row_major``: the tensors whose first
    dimension counts rows instead (a processor's per-token extras, as Qwen-VL's ``mm_token_type_ids``)."""

    tensors: dict[str, torch.Tensor]
    per_row: torch.Tensor
    patches: torch.Tensor | None = None
    row_major: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        images = int(self.per_row.sum())
        patches = None if self.patches is None else int(self.patches.sum())
        for name, tensor in self.tensors.items():
            if name in self.row_major:
                if tensor.shape[0] != self.rows:
                    raise ConfigError(f"image input {name!r} is by row, but has {tensor.shape[0]} rows for "
                                      f"{self.rows}")
            elif tensor.shape[0] not in (images, patches):
                counted = f"{images} images" + ("" if patches is None else f" or {patches} patches")
                raise ConfigError(f"image input {name!r} has {tensor.shape[0]} entries along its first dimension, "
                                  f"but the rows hold {counted} (images per row: {self.per_row.tolist()})")

    @property
    def rows(self) -> int:
        return len(self.per_row)

    def take(self, rows: slice) -> ImageBatch:
        """The images of ``rows`` (contiguous, as ``slice(start, stop)``)."""
        start, stop, _ = rows.indices(self.rows)
        before = self.per_row[:start].sum()
        first, last = int(before), int(before + self.per_row[start:stop].sum())
        patches = None if self.patches is None else self.patches[first:last]
        cuts = {int(self.per_row.sum()): (first, last)}  # by the length of a tensor's first dimension
        if self.patches is not None:
            cuts[int(self.patches.sum())] = (int(self.patches[:first].sum()), int(self.patches[:last].sum()))
        tensors = {name: t[start:stop] if name in self.row_major else t[slice(*cuts[t.shape[0]])]
                   for name, t in self.tensors.items()}
        return ImageBatch(tensors, self.per_row[start:stop], patches, self.row_major)

    def chunk(self, parts: int) -> list[ImageBatch]:
        """The images of each of the ``parts`` row ranges ``Tensor.chunk`` cuts the rows into."""
        size = -(-self.rows // parts)
        return [self.take(slice(start, start + size)) for start in range(0, self.rows, size)]

    def widened(self, width: int) -> ImageBatch:
        """These images with the processor's per-token tensors (``row_major``) zero filled on the right to ``width``
        tokens, as rows padded after their last token are (a completion after its prompt, a length rounded up to a
        multiple of tp)."""
        grown = {name: torch.nn.functional.pad(t, (0, width - t.shape[1])) for name, t in self.tensors.items()
                 if name in self.row_major and t.shape[1] < width}
        return replace(self, tensors={**self.tensors, **grown}) if grown else self

    def to(self, device: torch.device) -> ImageBatch:
        return ImageBatch({k: v.to(device) for k, v in self.tensors.items()}, self.per_row, self.patches,
                          self.row_major)

    def by_row(self) -> dict[str, torch.Tensor]:
        """Every tensor with rows as its first dimension (a row's images, or patches, zero padded to the most any
        row has), and the counts that undo it (``from_rows``): what a pipeline schedule can cut into micro-batches
        along dimension 0 as it cuts the token ids."""
        rows = [self.take(slice(r, r + 1)) for r in range(self.rows)]
        out = {"per_row": self.per_row.clone()}
        if self.patches is not None:
            most = max(int(self.per_row.max()), 1)
            out["patches"] = torch.stack([torch.nn.functional.pad(r.patches, (0, most - len(r.patches))) for r in rows])
        for name, tensor in self.tensors.items():
            if name in self.row_major:
                out[f"row:{name}"] = tensor
                continue
            parts = [r.tensors[name] for r in rows]
            most = max(max(len(p) for p in parts), 1)
            kind = "image" if tensor.shape[0] == int(self.per_row.sum()) else "patch"
            out[f"{kind}:{name}"] = torch.stack([torch.cat([p, p.new_zeros((most - len(p), *p.shape[1:]))])
                                               for p in parts])
        return out

    @classmethod
    def from_rows(cls, padded: dict[str, torch.Tensor]) -> ImageBatch:
        """The ``ImageBatch`` that ``by_row`` gave ``padded`` for (the rows of a micro-batch of it)."""
        per_row = padded["per_row"]
        patches = None
        if "patches" in padded:
            patches = torch.cat([padded["patches"][r, :n] for r, n in enumerate(per_row.tolist())])
        lengths = {"image": per_row.tolist()}
        if patches is not None:
            lengths["patch"] = [int(padded["patches"][r, :n].sum()) for r, n in enumerate(per_row.tolist())]
        tensors, row_major = {}, []
        for key, tensor in padded.items():
            kind, _, name = key.partition(":")
            if kind == "row":
                tensors[name] = tensor
                row_major.append(name)
            elif kind in lengths:
                tensors[name] = torch.cat([tensor[r, :n] for r, n in enumerate(lengths[kind])])
        return cls(tensors, per_row, patches, tuple(row_major))

    def inputs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments: none where these rows hold no image (the model then runs as a text
        model; an empty pixel tensor would reach the vision tower)."""
        return dict(self.tensors) if int(self.per_row.sum()) else {}

    def later_stage_inputs(self) -> dict[str, torch.Tensor]:
        """What a pipeline's stages after the first get of these rows: the processor's per-token tensors (Gemma 3's
        ``token_type_ids``, from which every stage's model builds the mask letting image tokens see each other), as
        the first stage gets them; never the pixels, which only the first stage's vision tower reads."""
        return {name: self.tensors[name] for name in self.row_major} if int(self.per_row.sum()) else {}


def per_layer_inputs(config: Any) -> bool:
    """Whether the model's language model projects per-layer inputs from its embeddings (Gemma 3n's, Gemma 4's
    ``hidden_size_per_layer_input``), which an image-text model makes with the image features merged in."""
    return bool(getattr(config.get_text_config(), "hidden_size_per_layer_input", None))


def vision_attends_both_ways(config: Any) -> bool:
    """Whether the config makes image tokens attend to each other both ways (Gemma 4's larger checkpoints)."""
    return getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"


def images_attend_both_ways(config: Any, images: ImageBatch) -> str | None:
    """Why an image-text model's image tokens attend to each other both ways (bidirectional blocks in its masks,
    which a causal split of the sequence cannot serve), or None: Gemma 3's and PaliGemma's processor's
    ``token_type_ids``, Gemma 4's ``use_bidirectional_attention='vision'`` (its larger models')."""
    if "token_type_ids" in images.row_major:
        return "its token_type_ids"
    if vision_attends_both_ways(config):
        return "use_bidirectional_attention='vision'"
    return None


def image_layouts_besides(config: Any, refused: str) -> str:
    """The layouts to name beside a refusal of an image-text model's images under ``refused`` ("pp" or "cp"): tp, dp
    and ZeRO, and the other of the two where the model's images do not keep it off as well (per-layer inputs made
    with the image features keep pp off; image tokens attending both ways, as its config says, keep cp off)."""
    other = {"pp": None if vision_attends_both_ways(config) else "cp",
             "cp": None if per_layer_inputs(config) else "pp"}[refused]
    return ", ".join(["tp", *([other] if other else []), "dp"]) + " and ZeRO"


def grid_positions(config: Any) -> bool:
    """Whether the model's rotary positions follow its images' grids (M-RoPE: Qwen-VL, GLM-4V), computed inside
    its forward from the ids and the grids rather than taken from position ids: an ``mrope_section`` in its text
    config's rope parameters, or in those of one of its layer types (Cohere Compass's)."""
    text = config.get_text_config()
    return any(_names_mrope(getattr(text, field, None)) for field in ("rope_scaling", "rope_parameters"))


def _names_mrope(rope: Any) -> bool:
    return isinstance(rope, dict) and ("mrope_section" in rope or any(_names_mrope(v) for v in rope.values()))


def _rope_index(model: nn.Module) -> Any:
    """The module whose ``get_rope_index`` computes a grid-position model's rotary positions (its inner model)."""
    return next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)


def _rope_index_needs(owner: Any) -> set[str]:
    """The arguments ``get_rope_index`` cannot do without, besides the ids."""
    parameters = inspect.signature(owner.get_rope_index).parameters.values()
    return {p.name for p in parameters if p.default is inspect.Parameter.empty and p.name != "input_ids"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def pipeline_unseen(model: nn.Module, images: ImageBatch | None) -> str | None:
    """What a model's later pipeline stages would need from the images and cannot get (only the first stage runs the
    vision tower): per-layer inputs projected from the embeddings the image features were merged into (Gemma 4's:
    every stage recomputes them, from its own embeddings, without the features; a float64 run at pp=2 was 9e-4 off
    one process's loss at step 1), rotary positions that follow the images' grids (M-RoPE: Qwen-VL, GLM-4V) where
    the model has no ``get_rope_index`` to compute them before the pipeline (``grid_position_ids``), or the
    processor's tensors lack one it needs (not asked where ``images`` is None: the model alone, before any batch).
    None: served (the processor's per-token tensors reach every stage: ``later_stage_inputs``)."""
    if per_layer_inputs(model.config):
        return ("its per-layer inputs, which its language model projects from the embeddings with the image features "
                "merged in (hidden_size_per_layer_input)")
    if not grid_positions(model.config):
        return None
    owner = _rope_index(model)
    if owner is None:
        return "its multimodal rotary positions (computed from the images' grids inside its forward)"
    missing = [] if images is None else sorted(_rope_index_needs(owner) - set(images.tensors))
    if missing:
        return f"its multimodal rotary positions, whose get_rope_index needs {', '.join(missing)}"
    return None


def grid_position_ids(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      images: ImageBatch) -> torch.Tensor | None:
    """A grid-position model's rotary position ids ([3, rows, seq]), computed once for all the pipeline's stages by
    the model's own ``get_rope_index`` from the ids, the mask and the images' grids, as its forward computes them
    where it holds the whole model; None where the model's positions do not follow grids or the rows hold no image
    (the model then counts positions as a text model, alike on every stage)."""
    inputs = images.inputs()
    if not grid_positions(model.config) or not inputs:
        return None
    owner = _rope_index(model)
    accepted = inspect.signature(owner.get_rope_index).parameters
    given = {name: value for name, value in inputs.items() if name in accepted}
    return owner.get_rope_index(input_ids, attention_mask=attention_mask, **given)[0]
