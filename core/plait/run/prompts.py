"""Files of prompts and their completions from a laid-out model: what ``plait generate`` writes and what
``plait train --eval_prompts`` logs at each evaluation.

A prompt file is JSON lines, each an object with a ``prompt`` string or chat ``messages`` (rendered with the
tokenizer's chat template and its generation prompt). Prompts are tokenized without special tokens (a chat template
writes its own) and left padded by hand with the tokenizer's pad token (its EOS where it has none), so the tokenizer
a run saves with its checkpoints is never changed. A completion ends at EOS (not shown) or before the first stop
string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.base.config import ConfigError

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


def read_prompts(path: Path, flag: str) -> list[dict[str, Any]]:
    """The prompt rows of ``path`` (given by ``flag``), each checked: one line naming the file, line and fix for the
    first bad one."""
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    rows = []
    for number, row in json_lines(path, "; each line is an object with 'prompt' or 'messages'"):
        prompt, messages = (row.get("prompt"), row.get("messages")) if isinstance(row, dict) else (None, None)
        if not (isinstance(prompt, str) and prompt or isinstance(messages, list) and messages):
            raise ConfigError(f"{path}:{number}: a line needs a non-empty 'prompt' string or a 'messages' list")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{flag} {path}: no prompts in it")
    return rows


def left_padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one batch, left padded with ``pad`` to the longest: ids and attention mask [rows, longest]."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + list(row) for row in rows], device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
    return ids, mask


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


def completion_text(tokens: list[int], tokenizer: Any, stop: Sequence[str]) -> tuple[str, int]:
    """A row's new tokens as text, ended at EOS (excluded) or before the first stop string; and how many tokens
    were generated for it (EOS counted)."""
    eos = tokenizer.eos_token_id
    count = tokens.index(eos) + 1 if eos in tokens else len(tokens)
    text = tokenizer.decode(tokens[: count - 1] if eos in tokens else tokens, skip_special_tokens=True)
    ends = [text.find(s) for s in stop if s in text]
    return (text[: min(ends)] if ends else text), count


def complete(
    pmodel: ParallelModel, tokenizer: Any, texts: list[str], *, batch_size: int, device: torch.device,
    max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
    stop: Sequence[str] = (),
) -> list[tuple[str, int]]:
    """Each text's completion and its count of new tokens, decoded ``batch_size`` prompts at a time (the global
    batch: a multiple of dp; the last batch filled with copies of its last prompt, so every batch splits alike) with
    the seed ``seed`` plus the batch's first index. Every rank calls it with the same texts (a collective)."""
    pad, done = pad_id(tokenizer), []
    for first in range(0, len(texts), batch_size):
        batch = texts[first: first + batch_size]
        batch += batch[-1:] * (batch_size - len(batch))
        ids, mask = left_padded([tokenizer(text, add_special_tokens=False)["input_ids"] for text in batch], pad, device)
        width = ids.shape[1]
        out = pmodel.generate(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed + first, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
        done += [completion_text(new, tokenizer, stop) for new in out[:, width:].tolist()]
    return done[: len(texts)]


class EvalPrompts:
    """``--eval_prompts``: the prompts rendered once at start-up (a bad file, a chat row without a template or a
    tokenizer that cannot pad refused there, before any process group), completed greedily from the training
    layout's own shards at each evaluation: the same completions as one process from the weights of that step."""

    def __init__(self, path: Path, tokenizer: Any, max_new_tokens: int, per_replica: int) -> None:
        rows = read_prompts(path, "--eval_prompts")
        if tokenizer is None:
            raise ConfigError(f"--eval_prompts {path}: the run has no tokenizer to write and read prompts with; "
                              f"give --tokenizer_name")
        pad_id(tokenizer)
        self.tokenizer, self.max_new_tokens, self.per_replica = tokenizer, max_new_tokens, per_replica
        self.texts = [render(row, tokenizer) for row in rows]

    def samples(self, pmodel: ParallelModel, device: torch.device) -> list[dict[str, str]]:
        """Each prompt with its completion, on every rank (every rank calls it), decoded a training batch of
        prompts at a time."""
        done = complete(pmodel, self.tokenizer, self.texts, batch_size=self.per_replica * pmodel.mesh.dp,
                        device=device, max_new_tokens=self.max_new_tokens)
        return [{"prompt": text, "completion": completion} for text, (completion, _) in zip(self.texts, done)]
