"""Preference pairs for an image-text policy, as TRL 1.16's DPOTrainer reads them (its vision collator,
``DataCollatorForVisionPreference``): chat ``prompt``, ``chosen`` and ``rejected`` beside the prompt's ``images`` (a
list) or ``image`` (one), paths relative to the file.

TRL's rules, kept: messages of plain strings get one image part per image before the first user turn's text
(``prepare_multimodal_messages``); the prompt is rendered with the template's generation prompt (or continuing a last
assistant turn), each completion as the render of prompt + completion past their shared start; the prompt is encoded
by the processor with its images (image tokens expanded), each completion by the processor as text, neither with
special tokens added (the template wrote them); a row is the prompt's ids then the completion's, cut to
``--block_size`` from the start (``keep_end`` would cut image tokens: refused, as TRL refuses it). Each pair's two rows
carry the prompt's images (``pair_images``).
"""

from __future__ import annotations

import sys
from itertools import takewhile
from pathlib import Path
from typing import Any

from plait.base.config import ConfigError
from plait.base.images import ImageBatch
from plait.run.methods.preference_data import Pair, check_row, is_conversational
from plait.run.prompts import json_lines
from plait.run.runtime import reports_data

def read_image_pairs(path: Path, processor: Any, max_length: int) -> list[Pair]:
    """Every row of a .jsonl of image-text preference rows, encoded as TRL's vision collator encodes them; a row whose
    prompt alone fills ``max_length`` is dropped and said, as ``read_pairs`` drops it."""
    from plait.data.vision import VisionEncoder, image_entries

    encoder, pairs, dropped = VisionEncoder(processor, path.parent, lazy=True), [], []
    for number, row in json_lines(path):
        where = f"{path} line {number}"
        if not isinstance(row, dict) or any(key not in row for key in ("prompt", "chosen", "rejected")):
            raise ConfigError(f"{where}: an image-text preference row needs 'prompt', 'chosen' and 'rejected' (chat "
                              f"messages) beside its 'images'")
        check_row(row, where)
        if not is_conversational(row):
            raise ConfigError(f"{where}: an image-text preference row is chat messages ('prompt': [{{\"role\": "
                              f"\"user\", \"content\": ...}}]), as TRL's vision collator renders them")
        entries = image_entries(row, where)
        prompt, chosen, rejected = _rendered(processor, row, len(entries), where)
        example = encoder.encode_rendered(prompt, entries, where)
        ids = lambda text: processor(text=[text], add_special_tokens=False)["input_ids"][0]  # noqa: E731
        pair = Pair(example.input_ids.tolist(), list(ids(chosen)), list(ids(rejected)), example)
        if pair.chosen == pair.rejected:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' are the same completion; a preference pair needs "
                              f"two different ones (drop the row)")
        if len(pair.prompt) < max_length:
            pairs.append(pair)
        else:
            dropped.append(number)
    if dropped and reports_data():
        print(f"note: dropped {len(dropped)} preference row(s) of {path} whose prompt with its image tokens alone "
              f"fills --block_size {max_length} (lines {', '.join(map(str, dropped[:5]))}), as TRL does; raise "
              f"--block_size to keep them", file=sys.stderr)
    if not pairs:
        raise ConfigError(f"--train_file {path}: no preference row to train on (every prompt fills --block_size "
                          f"{max_length}, or the file is empty)")
    return pairs


def _rendered(processor: Any, row: dict, images: int, where: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts as TRL's ``apply_chat_template`` renders a preference row."""
    from plait.data.vision import multimodal_messages

    prompt = multimodal_messages(row["prompt"], images, where)
    chosen, rejected = (multimodal_messages(row[k], 0, where) for k in ("chosen", "rejected"))
    parts = [sum(p.get("type") == "image" for m in messages for p in m["content"])
             for messages in (prompt, chosen, rejected)]
    if parts != [images, 0, 0]:
        raise ConfigError(f"{where}: {images} images for {parts[0]} image parts in its prompt and "
                          f"{parts[1] + parts[2]} in its completions; give one image per {{\"type\": \"image\"}} "
                          f"part of the prompt, in order")
    last = prompt[-1].get("role")
    render = processor.apply_chat_template
    try:
        text = render(prompt, tokenize=False, add_generation_prompt=last != "assistant",
                      continue_final_message=last == "assistant")
        with_chosen, with_rejected = render(prompt + chosen, tokenize=False), render(prompt + rejected, tokenize=False)
    except Exception as err:  # noqa: BLE001 (a template raises its own kinds: jinja's, ValueError)
        raise ConfigError(f"{where}: the chat template refused it: {' '.join(str(err).split())}") from None
    for other in (with_chosen, with_rejected):  # the shared start, as TRL's (a template may render them apart)
        text = "".join(a for a, _ in takewhile(lambda ab: ab[0] == ab[1], zip(text, other)))
    return text, with_chosen[len(text):], with_rejected[len(text):]


def pair_images(pairs: list[Pair], indices: list[int], width: int, pad: int) -> ImageBatch | None:
    """The image inputs of ``pair_rows``' rows of the pairs ``indices`` (each pair's chosen row, then its rejected
    row, both with the prompt's images), the processor's per-token tensors zero filled on the right to ``width``
    tokens; None for a text policy's pairs or rows without an image."""
    from plait.data.vision import collate

    examples = [pairs[i].example for i in indices for _ in range(2)]
    if examples[0] is None or not any(e.num_images for e in examples):
        return None
    return collate(examples, pad).images.widened(width)
