"""Image-text-to-text (vision-language) SFT data, in TRL's vision format: each row has ``messages`` (turns whose
``content`` is a str or a list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts) and ``images``
(one per image part, in order: a path, bytes, a PIL image, or the ``{"bytes", "path"}`` dict that a ``datasets``
Image column stores in parquet).

A row is rendered with the processor's chat template and run through the processor, which expands each image
placeholder into the model's image tokens and returns the pixel tensors. Labels follow the text chat SFT
convention (``plait.data.sft``): an assistant turn is the span between the conversation rendered up to it with
the generation prompt and rendered including it, so the end-of-turn token is trained on and any template works
without ``{% generation %}`` markers. The processor reports where it replaced each placeholder
(``return_text_replacement_offsets``), which maps the fast tokenizer's offsets in the expanded text back onto
the rendered one, so the spans land on the right tokens however many tokens an image expands to; image tokens
are never labelled, even inside an assistant turn (they are the vision tower's outputs, not text to predict).

Pixel tensors are batched by image (their first dimension counts images, or for Qwen-VL-style processors the
patches that ``image_grid_thw`` counts per image) in a ``plait.base.images.ImageBatch``, which cuts them by rows
for micro-batches and data-parallel shards. Everything runs offline: URLs are refused.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.base.config import ConfigError
from plait.base.images import ImageBatch
from plait.data.pixel_loader import Encoding, Joined, PixelLoader, Reload, pixels_of
from plait.data.processors import one_line
from plait.data.sources import jsonl_lines
from plait.tp.loss import IGNORE_INDEX

GRID_KEY = "image_grid_thw"  # Qwen-VL: (t, h, w) patches per image; their pixel_values have one row per patch
_TEXT_KEYS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")


def read_rows(path: str | Path) -> list[tuple[str, dict]]:
    """The rows of a .jsonl (one JSON object a line; blank lines skipped) or .parquet file, in file order, each with
    where it is for messages: "line N" of a .jsonl (as every other reader counts, from 1), "row N" of a .parquet.

    .jsonl lines come from ``jsonl_lines``, the reader the text and SFT formats share, so a non-UTF-8 or binary
    file is refused in the same one line (file, line, byte offset and the fix) whichever format it was given as,
    a BOM is read as utf-8-sig reads it, and line numbers count newlines only (not the Unicode separators that
    ``str.splitlines`` would also cut a JSON string at).
    """
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"{path}: image-text rows are read from .jsonl or .parquet files")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            return [(f"row {number}", row) for number, row in enumerate(pq.read_table(path).to_pylist(), start=1)]
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise ConfigError(f"{path}: cannot be read ({one_line(err)})") from err
    try:
        lines = [(line.number, line.text) for line in jsonl_lines(path)]
    except ValueError as err:  # jsonl_lines' one line already names the file, line, byte and the fix
        raise ConfigError(str(err)) from None
    rows = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} line {number}: not JSON ({err.msg} at column {err.colno})") from err
        if not isinstance(row, dict):
            raise ConfigError(f"{path} line {number}: not a JSON object (got {type(row).__name__})")
        rows.append((f"line {number}", row))
    return rows


@dataclass(frozen=True)
class Example:
    """One encoded row: 1-D ``input_ids``, ``attention_mask`` and ``labels``; ``tokens``: any other per-token
    tensor the processor returns (Qwen-VL's ``mm_token_type_ids``); ``pixels``: the image tensors, batched by
    image; ``num_images``; ``where`` names the row for messages; ``position_ids``: a packed row's, restarting at 0
    at each of its documents (None: one document); ``reload``: where the pixels are not kept (``VisionEncoder``'s
    ``lazy``), what encodes them again from the row's image files when a batch needs them (``pixels_of``), on a
    background thread that can start a step ahead (``plait.data.pixel_loader``)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    tokens: dict[str, torch.Tensor]
    pixels: dict[str, torch.Tensor]
    num_images: int
    where: str
    position_ids: torch.Tensor | None = None
    reload: Reload | None = None


def _messages(row: dict, where: str) -> tuple[list[dict], int]:
    """The row's turns with every content a list of parts (what vision chat templates iterate over, as TRL
    makes it) and no None fields (parquet gives every part every field), and the number of image parts."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: has no messages (a non-empty list of {{role, content}} turns)")
    out, images = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ConfigError(f"{where}: messages[{i}] is not a {{role, content}} turn (got {message!r:.80})")
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ConfigError(f"{where}: messages[{i}].content is a {type(content).__name__}, not a str or a list of "
                              f"parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image", "text") or (kind == "text" and not isinstance(part.get("text"), str)):
                raise ConfigError(f"{where}: messages[{i}].content[{j}] is not an image or text part "
                                  f"(got {part!r:.80})")
            images += kind == "image"
            parts.append({key: value for key, value in part.items() if value is not None})
        out.append({**{key: value for key, value in message.items() if value is not None}, "content": parts})
    return out, images


def read_image(entry: Any, base_dir: Path | None, where: str, number: int) -> Any:
    """One ``images`` entry as a loaded PIL image; paths resolve against ``base_dir`` (the data file's dir)."""
    from PIL import Image

    if isinstance(entry, Image.Image):
        return entry
    if isinstance(entry, dict):
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, str) and entry.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: images[{number}] is a URL ({entry}); images are read offline: download it "
                          f"and give its path")
    if isinstance(entry, (bytes, bytearray)):
        source, name = io.BytesIO(entry), f"{len(entry)} bytes"
    elif isinstance(entry, str):
        source = Path(entry) if base_dir is None or Path(entry).is_absolute() else base_dir / entry
        name = str(source)
    else:
        raise ConfigError(f"{where}: images[{number}] is a {type(entry).__name__}, not a path, bytes, a PIL image or "
                          f"a {{bytes, path}} dict")
    try:
        image = Image.open(source)
        image.load()  # decode now: a truncated file must fail here, naming it, not inside the processor
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        fix = f"; fix the path (a relative one is read from {base_dir})" if isinstance(err, FileNotFoundError) \
            and base_dir is not None else "; fix the path or the file" if isinstance(err, FileNotFoundError) else ""
        raise ConfigError(f"{where}: images[{number}] ({name}) cannot be read: {one_line(err)}{fix}") from err
    return image


def read_images(entries: list[Any], base_dir: Path | None, where: str) -> list[Any]:
    """A row's ``images`` entries, each read (``read_image``)."""
    return [read_image(entry, base_dir, where, number) for number, entry in enumerate(entries)]


def image_entries(row: dict, where: str) -> list[Any]:
    """A TRL prompt or preference row's images: its ``images`` (a list) or its ``image`` (one); none without
    either."""
    key = next((k for k in ("images", "image") if k in row), None)
    entries = [] if key is None or row[key] is None else row[key] if key == "images" else [row[key]]
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: 'images' is a {type(entries).__name__}; give a list of image paths")
    return entries


class VisionEncoder:
    """Rows -> ``Example``s through a transformers processor (``load_processor``); ``base_dir``: where relative
    image paths live (the data file's directory). ``lazy``: keep no pixels, only what encodes them again per batch
    (an image's pixel tensors are a megabyte and more: 1.3 MiB at 336 x 336 for CLIP, so a training set's would not
    fit in memory; bench/vision_memory.py); the rows are still encoded whole once, where a bad one is refused, and
    their image files are read again for each batch, so they must stay in place for the run, as the data file does."""

    def __init__(self, processor: Any, base_dir: str | Path | None = None, lazy: bool = False) -> None:
        tokenizer = processor.tokenizer
        name = getattr(tokenizer, "name_or_path", "") or f"the {type(processor).__name__}"
        if not getattr(processor, "chat_template", None):
            raise ConfigError(f"{name}: the processor has no chat template, which renders the conversations; give a "
                              f"model dir whose processor has one (chat_template.jinja)")
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"{name}: the processor's tokenizer is slow; labels are placed by token offsets, which "
                              f"need a fast (tokenizers-backed) one")
        image_token_id = getattr(processor, "image_token_id", None)
        if image_token_id is None and getattr(processor, "image_token", None):
            image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
        if image_token_id is None:
            raise ConfigError(f"{name}: the processor names no image token, so image tokens cannot be kept out of "
                              f"the labels")
        self.processor, self.image_token_id = processor, int(image_token_id)
        self.base_dir = None if base_dir is None else Path(base_dir)
        self.lazy = lazy
        self.loader = PixelLoader(processor) if lazy else None  # the pixels read again off the training thread

    def encode(self, row: dict, where: str, prompt: bool = False) -> Example:
        """A row (``where`` it is, for messages: its file and line) rendered, tokenized, labelled and its images
        processed; ``prompt``: a generation prompt (``plait generate``), rendered with the template's generation
        prompt after its turns and labelled nowhere."""
        messages, image_parts = _messages(row, where)
        entries = row.get("images") or []
        if not isinstance(entries, list) or len(entries) != image_parts:
            count = len(entries) if isinstance(entries, list) else f"a {type(entries).__name__} of"
            raise ConfigError(f"{where}: {count} images for {image_parts} image parts in its messages; give one image "
                              f"per {{\"type\": \"image\"}} part, in order")
        images = read_images(entries, self.base_dir, where)
        render = self.processor.apply_chat_template
        text = render(messages, tokenize=False, add_generation_prompt=prompt)
        bos = self.processor.tokenizer.bos_token
        try:  # a template that renders no BOS relies on the tokenizer adding it, as transformers' own chat path does
            out = self.processor(text=[text], images=images or None, return_tensors="pt", return_offsets_mapping=True,
                                 return_text_replacement_offsets=True,
                                 add_special_tokens=not (bos and text.startswith(bos)))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: the processor refused it: {one_line(err)}") from err
        ids = out["input_ids"][0]
        labels = torch.full_like(ids, IGNORE_INDEX) if prompt else \
            self._labels(ids, out, _assistant_spans(render, messages, text, where), where)
        return self._kept(_example(out, labels, len(images), where), text, entries, not (bos and text.startswith(bos)))

    def encode_rendered(self, text: str, entries: list[Any], where: str) -> Example:
        """A prompt already rendered (``text``) with its images' ``entries`` (paths, bytes, PIL images), as TRL's
        preference collator encodes it: no special tokens added (the template wrote them), labelled nowhere."""
        images = read_images(entries, self.base_dir, where)
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: the processor refused it: {one_line(err)}") from err
        example = _example(out, torch.full_like(out["input_ids"][0], IGNORE_INDEX), len(images), where)
        return self._kept(example, text, entries, False)

    def _kept(self, example: Example, text: str, entries: list[Any], special: bool) -> Example:
        """``example`` as it is kept: under ``lazy`` without its pixels, which ``_pixels`` encodes again."""
        if not self.lazy or not example.num_images:
            return example
        reload = Encoding(self.loader, self._pixels, text, list(entries), example.where, special)
        return dataclasses.replace(example, pixels={}, reload=reload)

    def _pixels(self, processor: Any, text: str, entries: list[Any], where: str, special: bool
                ) -> dict[str, torch.Tensor]:
        """The pixels of a row encoded before (the same text, images and special tokens: the same tensors), by
        ``processor`` (the loader's copy, on its thread)."""
        images = read_images(entries, self.base_dir, where)
        out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=special)
        return _example(out, out["input_ids"][0], len(images), where).pixels

    def encode_text(self, text: str, where: str) -> Example:
        """A text-only prompt string as the processor encodes it, its special tokens included (``tokenizer(text)``),
        labelled nowhere."""
        try:
            out = self.processor(text=[text], return_tensors="pt")
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: the processor refused it: {one_line(err)}") from err
        ids = out["input_ids"][0]
        extra = {key: value for key, value in out.items() if key not in _TEXT_KEYS and torch.is_tensor(value)}
        tokens = {key: value[0] for key, value in extra.items() if _per_token(key, value, out["input_ids"])}
        return Example(ids, out["attention_mask"][0], torch.full_like(ids, IGNORE_INDEX), tokens, {}, 0, where)

    def _labels(self, ids: torch.Tensor, out: Any, spans: list[tuple[int, int]], where: str) -> torch.Tensor:
        """Ids on tokens that start inside an assistant span of the rendered text, else -100; positions are
        moved back from the expanded text past each image's replacement, and tokens inside one are never labelled."""
        # Idefics3 reports replacements only when there are images; with none there is nothing to map back
        replacements = out["text_replacement_offsets"][0] if "text_replacement_offsets" in out else None
        if "offset_mapping" not in out or (replacements is None and (ids == self.image_token_id).any()):
            raise ConfigError(f"{where}: the {type(self.processor).__name__} does not report token offsets and where "
                              f"it expands images (return_offsets_mapping, return_text_replacement_offsets), which "
                              f"labels need")
        starts = out["offset_mapping"][0, :, 0].numpy().astype(np.int64)
        shift, inside = np.zeros_like(starts), np.zeros(len(starts), dtype=bool)
        for replaced in replacements or ():
            (lo, hi), (new_lo, new_hi) = replaced["span"], replaced["new_span"]
            inside |= (starts >= new_lo) & (starts < new_hi)
            shift += np.where(starts >= new_hi, (new_hi - new_lo) - (hi - lo), 0)
        starts = starts - shift
        trainable = np.zeros(len(starts), dtype=bool)
        for lo, hi in spans:
            trainable |= (starts >= lo) & (starts < hi)
        trainable &= ~inside & (ids.numpy() != self.image_token_id)
        trainable[:1] = False  # as in plait.data.sft_blocks: an example's first token is never predicted
        return torch.where(torch.from_numpy(trainable), ids, torch.full_like(ids, IGNORE_INDEX))


def _example(out: Any, labels: torch.Tensor, num_images: int, where: str) -> Example:
    """One row of the processor's output ``out`` as an ``Example``: its per-token tensors apart from its pixels."""
    extra = {key: value for key, value in out.items() if key not in _TEXT_KEYS and torch.is_tensor(value)}
    tokens = {key: value[0] for key, value in extra.items() if _per_token(key, value, out["input_ids"])}
    pixels = {key: value for key, value in extra.items() if key not in tokens}
    for key in pixels:  # refuse here, naming the row, a tensor that could not be cut by rows
        _units(key, pixels, num_images, where)
    return Example(out["input_ids"][0], out["attention_mask"][0], labels, tokens, pixels, num_images, where)


def check_images_everywhere(examples: list[Example | None], zero_stage: int) -> None:
    """Under ZeRO-2/3 FSDP reduces the vision tower's gradients only where it ran, so every micro-batch of every
    replica must hold an image (``ParallelModel`` refuses one without, at its step): where rows are drawn from
    ``examples`` at random (GRPO's prompts, DPO's pairs' prompts) each must hold one, or none may (a text run)."""
    bare = next((e for e in examples if e is not None and not e.num_images), None)
    if zero_stage >= 2 and bare is not None and any(e is not None and e.num_images for e in examples):
        raise ConfigError(f"{bare.where}: a prompt without an image, under --zero_stage {zero_stage}, where every "
                          f"micro-batch of every replica needs one (FSDP reduces the vision tower's gradients only "
                          f"where it ran); give every prompt an image, or use --zero_stage 1")


def multimodal_messages(messages: list, images: int, where: str) -> list[dict]:
    """TRL's ``prepare_multimodal_messages`` without filling the images in: every content a list of parts; where
    every content is a string, ``images`` image parts before the first user turn's text."""
    parts = lambda content: [{"type": "text", "text": content}] if isinstance(content, str) else content  # noqa: E731
    strings = all(isinstance(m.get("content"), str) for m in messages if isinstance(m, dict))
    out, placed = [], False
    for message in messages:
        if not isinstance(message, dict) or "content" not in message:
            raise ConfigError(f"{where}: messages must be {{role, content}} turns (got {message!r:.80})")
        content = parts(message["content"])
        if strings and not placed and message.get("role") == "user":
            content, placed = [{"type": "image"}] * images + content, True
        out.append({**message, "content": content})
    return out


def _assistant_spans(render: Any, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """The character spans of the assistant turns in ``text``, located as ``plait.data.sft.SFTEncoder`` does
    (its loop is inside a tokenizer-bound method, so it is restated here for the processor's renderer)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = render(messages[: i + 1], tokenize=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(f"{where}: the chat template does not render a conversation's beginning as a prefix of "
                              f"the whole, so assistant turns cannot be located; use a template that does")
        spans.append((len(before), len(upto)))
    return spans


def _per_token(key: str, value: torch.Tensor, input_ids: torch.Tensor) -> bool:
    """Whether a processor output is per token (shaped like input_ids, as Qwen-VL's mm_token_type_ids) rather
    than per image; by shape and name, so a small image tensor shaped like the ids by chance is still pixels."""
    return value.shape == input_ids.shape and not key.startswith(("pixel", "image"))


def _units(key: str, pixels: dict[str, torch.Tensor], num_images: int, where: str) -> torch.Tensor:
    """How many entries of ``pixels[key]``'s first dimension each image has: 1, or its patches (t*h*w of
    ``image_grid_thw``) for Qwen-VL's pixel_values. Anything else cannot be cut by rows and is refused."""
    length = pixels[key].shape[0] if pixels[key].dim() else -1
    if length == num_images:
        return torch.ones(num_images, dtype=torch.long)
    if GRID_KEY in pixels:
        patches = pixels[GRID_KEY].long().prod(dim=-1)
        if length == int(patches.sum()):
            return patches
    raise ConfigError(f"{where}: the processor's {key} has shape {tuple(pixels[key].shape)} for {num_images} images; "
                      f"its first dimension must count images (or {GRID_KEY} patches) to batch it by rows")


@dataclass(frozen=True)
class VisionBatch:
    """A batch of encoded rows: the token tensors [rows, longest] (right padded) and the rows' image inputs;
    ``position_ids`` where rows are packed (each pad a document of its own), else None."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    images: ImageBatch
    position_ids: torch.Tensor | None = None

    def take(self, rows: slice) -> VisionBatch:
        """The rows ``rows`` (contiguous), with their images' tensors."""
        positions = None if self.position_ids is None else self.position_ids[rows]
        return VisionBatch(self.input_ids[rows], self.attention_mask[rows], self.labels[rows], self.images.take(rows),
                           positions)


def pack(examples: list[Example], block_size: int) -> list[Example]:
    """Examples in rows of at most ``block_size`` tokens, in order, each row filled while the next example fits:
    the tokens, labels and per-token extras concatenated, the images one after another as their documents are (an
    image-text model merges image features into its image tokens in order), and position ids restarting at 0 at
    each document, which transformers' mask reads to keep documents apart."""
    rows, current = [], []
    for example in examples:
        if current and sum(len(e.input_ids) for e in current) + len(example.input_ids) > block_size:
            rows.append(current)
            current = []
        current.append(example)
    rows.append(current)
    return [_joined(row) for row in rows if row]


def _joined(row: list[Example]) -> Example:
    with_images = [e for e in row if e.num_images]
    lazy = any(e.reload is not None for e in with_images)  # then the joined row's pixels are encoded when needed
    joined = Joined(with_images)
    return Example(torch.cat([e.input_ids for e in row]), torch.cat([e.attention_mask for e in row]),
                   torch.cat([e.labels for e in row]),
                   {key: torch.cat([e.tokens[key] for e in row]) for key in row[0].tokens},
                   {} if lazy else joined(), sum(e.num_images for e in row),
                   " + ".join(e.where for e in row), torch.cat([torch.arange(len(e.input_ids)) for e in row]),
                   joined if lazy else None)


def collate(examples: list[Example], pad_id: int) -> VisionBatch:
    """A batch of ``examples``: per-token tensors right-padded to the longest (``pad_id``, attention 0, labels
    -100, the processor's others 0, kept with the images by row), pixel tensors concatenated by image in row
    order (``plait.base.images.ImageBatch``, which cuts them by rows for micro-batches and replicas)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    width = max(len(example.input_ids) for example in examples)
    fills = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    fills.update(dict.fromkeys(examples[0].tokens, 0))
    batch = {key: torch.full((len(examples), width), fill, dtype=torch.long) for key, fill in fills.items()}
    for r, example in enumerate(examples):
        per_token = {"input_ids": example.input_ids, "attention_mask": example.attention_mask,
                     "labels": example.labels, **example.tokens}
        if per_token.keys() != fills.keys():
            raise ValueError(f"{example.where}: per-token tensors {sorted(per_token)} differ from the batch's "
                             f"{sorted(fills)}; encode every row with one processor")
        for key, value in per_token.items():
            batch[key][r, : len(value)] = value
    pixels = {}
    with_images = [example for example in examples if example.num_images]
    # each example's once (a GRPO prompt's generations, a DPO pair's two rows are the same example)
    found = {id(example): pixels_of(example) for example in with_images}
    by_row = [found[id(example)] for example in with_images]
    for key in dict.fromkeys(key for loaded in by_row for key in loaded):
        missing = [example.where for example, loaded in zip(with_images, by_row) if key not in loaded]
        if missing:
            raise ValueError(f"{missing[0]}: has images but no {key}, which other rows have; encode every row with "
                             f"one processor")
        (first, first_pixels), *others = zip(with_images, by_row)
        for other, other_pixels in others:
            if first_pixels[key].shape[1:] != other_pixels[key].shape[1:]:
                raise ConfigError(f"{first.where} and {other.where}: the processor gives their images {key} of "
                                  f"shapes {tuple(first_pixels[key].shape)} and {tuple(other_pixels[key].shape)}, "
                                  f"which cannot be concatenated into one batch")
        pixels[key] = torch.cat([loaded[key] for loaded in by_row])
    per_row = torch.tensor([example.num_images for example in examples], dtype=torch.long)
    patches = pixels[GRID_KEY].long().prod(dim=-1) if GRID_KEY in pixels else None
    extras = {key: batch.pop(key) for key in examples[0].tokens}
    images = ImageBatch({**pixels, **extras}, per_row, patches, row_major=tuple(extras))
    positions = None
    if any(example.position_ids is not None for example in examples):  # packed: a pad is a document of its own
        positions = torch.zeros_like(batch["input_ids"])
        for r, example in enumerate(examples):
            own = example.position_ids if example.position_ids is not None else torch.arange(len(example.input_ids))
            positions[r, : len(own)] = own
    return VisionBatch(batch["input_ids"], batch["attention_mask"], batch["labels"], images, positions)
