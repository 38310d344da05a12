"""Files of prompts and their completions from a laid-out model: what ``plait generate`` writes and what
``plait train --eval_prompts`` logs at each evaluation.

A prompt file is JSON lines, each an object with a ``prompt`` string or chat ``messages`` (rendered with the
tokenizer's chat template and its generation prompt). A ``prompt`` string is tokenized as transformers' tokenizer call
does by default, its special tokens (a BOS) included, so that greedy decoding is ``generate``'s on the same text; a
rendered chat without them (the template writes its own, as ``apply_chat_template`` tokenizes). Prompts are left
padded by hand with the tokenizer's pad token (its EOS where it has none), so the tokenizer a run saves with its
checkpoints is never changed. A completion ends at an end token (not shown): the model's generation config's
``eos_token_id``, one or a list (a chat model's end of turn), as ``generate`` ends; or before the first stop string,
where decoding stops as transformers' ``generate(stop_strings=...)`` stops (its ``StopStringCriteria``).
Rows with images are refused for a text model (the images would not reach it); an image-text model's processor
encodes them as training does (``encode_image_prompts``), their pixels going to the prompts' forward. A prompt whose
tokens and new tokens need more positions than the model has is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import StopStringCriteria

from plait.base.config import ConfigError
from plait.base.images import ImageBatch

if TYPE_CHECKING:
    from plait.parallel_model import ParallelModel


def json_lines(path: Path, hint: str = "") -> Iterator[tuple[int, Any]]:
    """Each non-blank line of ``path`` with its number, parsed; one line naming the file and line (and ``hint``) for
    the first that is not JSON."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: not JSON ({err.msg}){hint}") from None


@dataclass(frozen=True)
class PromptRow:
    """A prompt file's row: its line, the row as read, its text (``render``) and its token ids (``encode_prompts``);
    for an image-text model its processor's encoding (``encode_image_prompts``: the ids, per-token tensors, pixels)."""

    line: int
    row: dict[str, Any]
    text: str
    ids: list[int]
    example: Any = None


def read_prompts(path: Path, flag: str, images: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """The prompt rows of ``path`` (given by ``flag``) with their line numbers, each checked: one line naming the
    file, line and fix for the first bad one. ``images``: rows may hold images (an image-text model's prompts, in
    TRL's vision format: ``messages`` with image parts and ``images``)."""
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    rows = []
    for number, row in json_lines(path, "; each line is an object with 'prompt' or 'messages'"):
        prompt, messages = (row.get("prompt"), row.get("messages")) if isinstance(row, dict) else (None, None)
        if not (isinstance(prompt, str) and prompt or isinstance(messages, list) and messages):
            raise ConfigError(f"{path}:{number}: a line needs a non-empty 'prompt' string or a 'messages' list")
        pictured = row.get("images") or any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            isinstance(part, dict) and part.get("type") == "image" for part in m["content"]) for m in messages or [])
        if pictured and not images:
            raise ConfigError(f"{path}:{number}: the row has images, but {flag} completes text prompts only (the "
                              f"images would not reach the model); give its text alone")
        if pictured and messages is None:
            raise ConfigError(f"{path}:{number}: a prompt with images is given as 'messages' with image parts beside "
                              f"its 'images' (TRL's vision format), not as a 'prompt' string")
        rows.append((number, row))
    if not rows:
        raise ConfigError(f"{flag} {path}: no prompts in it")
    return rows


def encode_prompts(rows: list[tuple[int, dict[str, Any]]], tokenizer: Any) -> list[PromptRow]:
    """``read_prompts``' rows rendered (``render``) and tokenized: a ``prompt`` string as ``tokenizer(prompt)`` gives
    its ids (special tokens included, as transformers users tokenize for ``generate``), rendered ``messages``
    without them (the template writes its own)."""
    encoded = []
    for number, row in rows:
        text = render(row, tokenizer)
        encoded.append(PromptRow(number, row, text, tokenizer(text, add_special_tokens="prompt" in row)["input_ids"]))
    return encoded


def encode_image_prompts(rows: list[tuple[int, dict[str, Any]]], processor: Any, path: Path) -> list[PromptRow]:
    """An image-text model's prompt rows of file ``path`` through its processor (``plait.data.vision``, as training
    encodes them): the chat rendered with the generation prompt, each image placeholder expanded into the model's
    image tokens, the pixels encoded again for each batch (``lazy``: a file of prompts' pixels are not kept); a
    ``prompt`` string (text only) tokenized with its special tokens."""
    from plait.data.vision import VisionEncoder

    encoder, encoded = VisionEncoder(processor, path.parent, lazy=True), []
    for number, row in rows:
        where = f"{path}:{number}"
        if "prompt" in row:
            text, example = row["prompt"], encoder.encode_text(row["prompt"], where)
        else:
            example = encoder.encode(row, where, prompt=True)  # a bad row refused here, naming its line
            text = processor.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        encoded.append(PromptRow(number, row, text, example.input_ids.tolist(), example))
    return encoded


def check_room(path: Path, prompts: list[PromptRow], new_tokens: int, flag: str, config: Any) -> None:
    """Refuse a prompt whose tokens and ``new_tokens`` (given by ``flag``) need more positions than the model's
    ``max_position_embeddings``: learned positions end there (an IndexError mid-run), rotary ones were never
    trained past it."""
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions is None:
        return
    for prompt in prompts:
        if len(prompt.ids) + new_tokens > positions:
            fix = f"give {flag} {positions - len(prompt.ids)} or less" if len(prompt.ids) < positions else \
                "shorten the prompt"
            raise ConfigError(f"{path}:{prompt.line}: the prompt's {len(prompt.ids)} tokens and {flag} {new_tokens} "
                              f"need {len(prompt.ids) + new_tokens} positions, more than the model's "
                              f"max_position_embeddings={positions}; {fix}")


def end_ids(tokenizer: Any, generation_config: Any) -> list[int]:
    """The tokens a completion ends at: the generation config's ``eos_token_id`` (one or a list), as transformers'
    ``generate`` ends; else the tokenizer's EOS; none where neither has one."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = tokenizer.eos_token_id if ids is None else ids
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def left_padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one batch, left padded with ``pad`` to the longest: ids and attention mask [rows, longest]."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + list(row) for row in rows], device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
    return ids, mask


def left_images(examples: list[Any], pad: int) -> ImageBatch:
    """The image inputs of a batch of encoded prompts (``plait.data.vision.collate``'s), the processor's per-token
    tensors moved to the right end of each row as ``left_padded`` moves the ids (zeros in front)."""
    from plait.data.vision import collate

    images = collate(examples, pad).images
    lengths = [len(example.input_ids) for example in examples]
    tensors = dict(images.tensors)
    for name in images.row_major:
        moved = torch.zeros_like(tensors[name])
        for r, length in enumerate(lengths):
            moved[r, moved.shape[1] - length:] = tensors[name][r, :length]
        tensors[name] = moved
    return dataclasses.replace(images, tensors=tensors)


def render(row: dict[str, Any], tokenizer: Any) -> str:
    """A row's prompt text: its ``prompt``, or its ``messages`` through the chat template."""
    if "prompt" in row:
        return row["prompt"]
    if not tokenizer.chat_template:
        raise ConfigError("a prompt has 'messages' but the tokenizer has no chat template: give 'prompt' strings or "
                          "a --tokenizer_name with a template")
    return tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)


def pad_id(tokenizer: Any) -> int:
    """The id prompts are left padded with: the pad token's, else EOS's; one line where there is neither."""
    found = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if found is None:
        where = tokenizer.name_or_path or "trained on the data"
        raise ConfigError(f"the tokenizer ({type(tokenizer).__name__}, {where}) has neither a pad nor an EOS token: "
                          f"generation cannot pad prompts; give a --tokenizer_name that has one")
    return found


def completion_text(tokens: list[int], tokenizer: Any, stop: Sequence[str], ends: Sequence[int] = (),
                    ) -> tuple[str, int]:
    """A row's new tokens as text, ended at the first of ``ends`` (excluded; default the tokenizer's EOS) or before
    the first stop string; and how many tokens were generated for it: the end token counted, or the tokens up to the
    one that completed the stop string (where decoding stopped the row; pads follow)."""
    ends = ends or [tokenizer.eos_token_id]
    at = next((i for i, token in enumerate(tokens) if token in ends), None)
    count = len(tokens) if at is None else at + 1
    text = tokenizer.decode(tokens[:at], skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    if not cuts:
        return text, count
    low, high = 1, len(tokens[:at])  # the fewest tokens whose text holds a stop string (it holds for ``high``)
    while low < high:
        middle = (low + high) // 2
        if any(s in tokenizer.decode(tokens[:middle], skip_special_tokens=True) for s in stop):
            high = middle
        else:
            low = middle + 1
    return text[: min(cuts)], high


def complete(
    pmodel: ParallelModel, tokenizer: Any, prompts: list[list[int]], *, batch_size: int, device: torch.device,
    max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
    stop: Sequence[str] = (), ends: Sequence[int] = (), examples: list[Any] | None = None,
) -> list[tuple[str, int]]:
    """Each prompt's (token ids') completion and its count of new tokens, decoded ``batch_size`` prompts at a time
    (the global batch: a multiple of dp; the last batch filled with copies of its last prompt, so every batch splits
    alike) with the seed ``seed`` plus the batch's first index, ended at ``ends`` (``end_ids``; default the
    tokenizer's EOS). ``examples``: an image-text model's prompts as its processor encoded them (``PromptRow.example``:
    their images reach the prompts' forward). Every rank calls it with the same prompts (a collective)."""
    pad, done, ends = pad_id(tokenizer), [], list(ends) or [tokenizer.eos_token_id]
    criteria = StopStringCriteria(tokenizer, list(stop)) if stop else None  # a row's decoding ends at a stop string
    for first in range(0, len(prompts), batch_size):
        rows = list(range(first, min(first + batch_size, len(prompts))))
        rows += rows[-1:] * (batch_size - len(rows))
        ids, mask = left_padded([prompts[r] for r in rows], pad, device)
        images = None if examples is None else left_images([examples[r] for r in rows], pad).to(device)
        width = ids.shape[1]
        out = pmodel.generate(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed + first, eos_token_id=ends, pad_token_id=pad,
                              stopping_criteria=criteria, images=images)
        done += [completion_text(new, tokenizer, stop, ends) for new in out[:, width:].tolist()]
    return done[: len(prompts)]


class EvalPrompts:
    """``--eval_prompts``: the prompts rendered once at start-up (a bad file, a chat row without a template, a
    prompt with --eval_max_new_tokens past the model's positions or a tokenizer that cannot pad refused there,
    before any process group), completed greedily from the training layout's own shards at each evaluation: the
    same completions as one process from the weights of that step."""

    def __init__(self, path: Path, tokenizer: Any, max_new_tokens: int, per_replica: int, config: Any,
                 processor: Any = None) -> None:
        """``processor``: an image-text model's, which encodes the prompts and their images
        (``encode_image_prompts``)."""
        rows = read_prompts(path, "--eval_prompts", images=processor is not None)
        if tokenizer is None:
            raise ConfigError(f"--eval_prompts {path}: the run has no tokenizer to write and read prompts with; "
                              f"give --tokenizer_name")
        pad_id(tokenizer)
        self.tokenizer, self.max_new_tokens, self.per_replica = tokenizer, max_new_tokens, per_replica
        self.prompts = encode_prompts(rows, tokenizer) if processor is None else \
            encode_image_prompts(rows, processor, path)
        check_room(path, self.prompts, max_new_tokens, "--eval_max_new_tokens", config)

    @classmethod
    def of_run(cls, args: Any, tokenizer: Any, config: Any, layout: Any) -> EvalPrompts | None:
        """A run's --eval_prompts rendered with its tokenizer (an image-text model's: with its processor, images
        and all), each prompt checked, and a ZeRO-2/3 batch at the run's ``layout`` (a ParallelConfig) that gives a
        replica no image refused (None without the flag)."""
        if not args.eval_prompts:
            return None
        from plait.base.meta import takes_images

        processor = None
        folder = args.tokenizer_name or args.model_name_or_path
        if takes_images(config) and folder is not None:
            from plait.data.processors import load_processor

            processor = load_processor(folder)
        found = cls(Path(args.eval_prompts), tokenizer, args.eval_max_new_tokens, args.per_device_train_batch_size,
                    config, processor)
        images = [0 if p.example is None else p.example.num_images for p in found.prompts]
        if any(images) and layout.fsdp:
            from plait.generation.images import check_replicas_hold_images

            check_replicas_hold_images(images, found.per_replica * layout.dp, layout.dp, "--eval_prompts",
                                       f"--zero_stage {layout.zero_stage}")
        return found

    def samples(self, pmodel: ParallelModel, device: torch.device) -> list[dict[str, str]]:
        """Each prompt with its completion, on every rank (every rank calls it), decoded a training batch of
        prompts at a time, ended where the model's generation config ends it."""
        examples = [p.example for p in self.prompts] if self.prompts[0].example is not None else None
        done = complete(pmodel, self.tokenizer, [p.ids for p in self.prompts],
                        batch_size=self.per_replica * pmodel.mesh.dp, device=device,
                        max_new_tokens=self.max_new_tokens, examples=examples,
                        ends=end_ids(self.tokenizer, getattr(pmodel.module, "generation_config", None)))
        return [{"prompt": p.text, "completion": completion} for p, (completion, _) in zip(self.prompts, done)]
