"""GRPO's prompt rows, as TRL's GRPOTrainer reads them: text or chat ``prompt`` with the row's other columns for the
reward functions, and for an image-text policy its images.

An image-text policy's row is TRL's vision prompt: chat messages in ``prompt`` beside ``images`` (a list) or ``image``
(one), paths relative to the file as training's rows give them. As TRL's ``prepare_multimodal_messages``, messages
whose contents are all strings get one image part per image before the first user turn's text; messages with image
parts keep them (one image per part). The model's processor renders and encodes each prompt as ``plait generate``
does (``plait.run.prompts.encode_image_prompts``: the chat template's generation prompt, each image part expanded into
the model's image tokens); the reward functions get the messages with each image part holding its image, and the
image column as PIL images, as TRL hands them over (read from the files when the rewards are called: no prompt keeps
its pixels or its images between steps). A prompt string beside images is refused, as TRL refuses it
("Multimodal training requires conversational prompts"); one without images is the processor's text.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.base.config import ConfigError
from plait.base.images import ImageBatch
from plait.run.prompts import json_lines, left_images

@dataclasses.dataclass
class Prompt:
    """One prompt row: as TRL's reward functions get it (text or chat messages), its tokens, its other columns and,
    for an image-text policy, its encoding (``plait.data.vision.Example``, which keeps no pixels) and what reads its
    images (``pictures``: none are kept between steps either)."""

    prompt: str | list
    ids: list[int]
    columns: dict[str, Any]
    example: Any = None
    pictures: Callable[[], list[Any]] | None = None

    def for_rewards(self) -> tuple[str | list, dict[str, Any]]:
        """The prompt and its other columns as TRL's reward functions get them: an image-text prompt's images read
        now, into its image parts and its image column (PIL images, as TRL's datasets decode them)."""
        if self.pictures is None:
            return self.prompt, self.columns
        pictures = self.pictures()
        each = iter(pictures)
        prompt = [{**m, "content": [{**p, "image": next(each)} if p["type"] == "image" else p for p in m["content"]]}
                  for m in self.prompt]
        columns = dict(self.columns)
        if "images" in columns:
            columns["images"] = pictures
        elif "image" in columns:
            columns["image"] = next(iter(pictures), None)
        return prompt, columns


def read_prompts(path: Path, tokenizer: Any, room: int) -> list[Prompt]:
    """TRL's prompt-only rows of a .jsonl: ``prompt`` as text or chat messages (the template's generation prompt
    added), its other keys passed to the reward functions; one line for a bad row or a prompt over ``room`` tokens."""
    rows = []
    for number, row in json_lines(path):
        prompt = _prompt(row, path, number)
        if isinstance(prompt, list):
            if not tokenizer.chat_template:
                raise ConfigError(f"{path}:{number}: a chat prompt, but the tokenizer has no chat template")
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        else:
            text = prompt
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        _check_room(path, number, len(ids), room)
        rows.append(Prompt(prompt, ids, {k: v for k, v in row.items() if k != "prompt"}))
    return _some(rows, path)


def read_image_prompts(path: Path, processor: Any, room: int) -> list[Prompt]:
    """An image-text policy's prompt rows of a .jsonl (module docstring), encoded by its ``processor``."""
    from plait.data.vision import VisionEncoder, image_entries, multimodal_messages, read_images

    encoder, rows = VisionEncoder(processor, path.parent, lazy=True), []
    for number, row in json_lines(path):
        prompt, where = _prompt(row, path, number), f"{path}:{number}"
        entries = image_entries(row, where)
        if isinstance(prompt, str):
            if entries:
                raise ConfigError(f"{where}: a prompt string with images; an image-text prompt is chat messages "
                                  f"(\"prompt\": [{{\"role\": \"user\", \"content\": ...}}]), as TRL requires")
            example = encoder.encode_text(prompt, where)
            pictures = None
        else:
            prompt = multimodal_messages(prompt, len(entries), where)
            example = encoder.encode({"messages": prompt, "images": entries}, where, prompt=True)  # reads them
            pictures = functools.partial(read_images, list(entries), path.parent, where)
        _check_room(path, number, len(example.input_ids), room)
        rows.append(Prompt(prompt, example.input_ids.tolist(), {k: v for k, v in row.items() if k != "prompt"},
                           example, pictures))
    return _some(rows, path)


def prompt_images(prompts: list[Prompt], pad: int, width: int = 0) -> ImageBatch | None:
    """The image inputs of ``prompts`` left padded as ``left_padded`` pads their ids, the processor's per-token
    tensors zero filled on the right to ``width`` tokens (the completions after the prompt: TRL extends Gemma 3's
    token types with zeros); None for a text policy's prompts or rows without an image."""
    if prompts[0].example is None or not any(p.example.num_images for p in prompts):
        return None
    return left_images([p.example for p in prompts], pad).widened(width)


def _prompt(row: Any, path: Path, number: int) -> str | list:
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not (isinstance(prompt, list) and prompt) and not (isinstance(prompt, str) and prompt):
        raise ConfigError(f"{path}:{number}: a row needs a 'prompt' (text or a list of chat messages)")
    return prompt


def _check_room(path: Path, number: int, tokens: int, room: int) -> None:
    if tokens > room:
        raise ConfigError(f"{path}:{number}: the prompt has {tokens} tokens, more than the {room} left for it "
                          f"(--block_size minus --max_completion_length); shorten it or raise --block_size")


def _some(rows: list[Prompt], path: Path) -> list[Prompt]:
    if not rows:
        raise ConfigError(f"--train_file {path}: no prompts in it")
    return rows
