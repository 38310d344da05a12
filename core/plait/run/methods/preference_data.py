"""Preference data as TRL 1.16's DPOTrainer reads and tokenizes it, so that a recipe moved from TRL trains on the
same token ids: rows of ``prompt``, ``chosen`` and ``rejected``, plain text or conversational (lists of
``{"role", "content"}`` messages rendered with the tokenizer's chat template), or without ``prompt`` (the implicit
form: the prompt is what chosen and rejected share at their start).

TRL's rules, kept as they are: a plain completion gets the tokenizer's EOS appended unless it ends with it; the
prompt and each prompt+completion are tokenized whole, and the completion starts where the prompt's ids and the
prompt+completion's ids first differ (a chat template may render the prompt alone differently; tokens may merge
across the boundary); the implicit prompt is cut by TRL's ``extract_prompt``, quirks included (a space before the
cut stays with the completion; completions that are prefixes of each other cut one element early).
tests/test_preference_data.py holds every form to TRL's own preprocessing, and the rows a batch is made of to TRL's
collator.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.base.config import ConfigError
from plait.run.runtime import reports_data
from plait.tp.loss import IGNORE_INDEX

KEYS = ("prompt", "chosen", "rejected")


def is_conversational(example: dict[str, Any]) -> bool:
    """Whether the row's texts are lists of chat messages (TRL's test: the first message has a role)."""
    value = next((example[key] for key in KEYS if key in example), None)
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def check_row(example: dict[str, Any], where: str) -> None:
    """Refuse, naming the row (``where``: file and line) and the field, what TRL's preprocessing would stop on with a
    bare Python error (or, for a chat message without 'content', a template's): a field that is neither a text nor a
    list of chat messages (null, a number), a row mixing the two forms (its prompt as messages, a completion as
    text), a message without a text 'role' and a 'content'."""
    forms = {}
    for key in (key for key in KEYS if key in example):
        value = example[key]
        if isinstance(value, list) and value:
            for number, message in enumerate(value, 1):
                wrong = "is not a JSON object" if not isinstance(message, dict) else \
                    "has no text 'role'" if not isinstance(message.get("role"), str) else \
                    "has no 'content'" if "content" not in message else None
                if wrong:
                    found = f"its keys: {sorted(message)}" if isinstance(message, dict) else json.dumps(message)[:40]
                    raise ConfigError(f"{where}: {key!r} message {number} {wrong} ({found}); a chat message is "
                                      f"{{\"role\": ..., \"content\": ...}}")
            forms[key] = "a list of chat messages"
        elif isinstance(value, str):
            forms[key] = "a text"
        else:
            kind = "a boolean" if isinstance(value, bool) else \
                "a JSON object" if isinstance(value, dict) else "a number"
            what = "null" if value is None else "an empty list" if value == [] else \
                f"{kind} ({json.dumps(value)[:40]})"
            raise ConfigError(f"{where}: {key!r} is {what}; give it as a text, or as a list of chat messages "
                              f"({{\"role\": ..., \"content\": ...}})")
    (first, form), *others = forms.items()
    other = next((item for item in others if item[1] != form), None)
    if other is not None:
        raise ConfigError(f"{where}: {first!r} is {form} but {other[0]!r} is {other[1]}; give "
                          f"{', '.join(map(repr, forms))} all as texts or all as lists of chat messages")


def extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """The implicit form's prompt: the start chosen and rejected share (characters, or whole messages), cut as TRL's
    ``extract_prompt`` cuts it."""
    chosen, rejected = example["chosen"], example["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space before the completion stays with it
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def tokenize_pair(tokenizer: Any, example: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one preference row; ``where`` names it (file and line) in errors."""
    missing = [key for key in ("chosen", "rejected") if key not in example]
    if missing:
        raise ConfigError(f"{where}: a preference row needs 'chosen' and 'rejected' (and 'prompt', or a shared start "
                          f"of the two); missing {missing}, found {sorted(example)}")
    check_row(example, where)
    if "prompt" not in example:
        example = extract_prompt(example)
    if is_conversational(example):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{where}: conversational preference rows need a tokenizer with a chat template")
        prompt = _chat_ids(tokenizer, example["prompt"], add_generation_prompt=True)
        with_chosen = _chat_ids(tokenizer, example["prompt"] + example["chosen"])
        with_rejected = _chat_ids(tokenizer, example["prompt"] + example["rejected"])
    else:
        eos = tokenizer.eos_token
        chosen, rejected = (text if text.endswith(eos) else text + eos
                            for text in (example["chosen"], example["rejected"]))
        prompt = tokenizer(text=example["prompt"])["input_ids"]
        with_chosen = tokenizer(text=example["prompt"] + chosen)["input_ids"]
        with_rejected = tokenizer(text=example["prompt"] + rejected)["input_ids"]
    start = min(_shared(prompt, with_chosen), _shared(prompt, with_rejected))
    return prompt[:start], with_chosen[start:], with_rejected[start:]


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def _shared(ids: list[int], other: list[int]) -> int:
    """How many leading ids the two lists have in common."""
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


@dataclass(frozen=True)
class Pair:
    """One preference row's token ids: the prompt, and the chosen and rejected completions after it; for an
    image-text policy the prompt's encoding with its images (``plait.data.vision.Example``)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    example: Any = None


def read_pairs(path: Path, tokenizer: Any, max_length: int, truncation_mode: str) -> list[Pair]:
    """Every row of a .jsonl preference file, tokenized as TRL does; as TRL, a row whose prompt alone fills
    ``max_length`` is dropped under ``keep_start`` truncation (it would keep no completion token), said in one line
    on stderr. A row whose two completions are the same is refused: it teaches nothing and is most often a mistake."""
    if path.suffix != ".jsonl":
        raise ConfigError(f"--train_file {path}: preference data is read from .jsonl files (one row per line, "
                          f"'prompt', 'chosen' and 'rejected'); convert it, e.g. with datasets' to_json")
    pairs, dropped = [], []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except ValueError as err:
                raise ConfigError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: not a JSON object; a preference row holds 'prompt', 'chosen' and "
                                  f"'rejected'")
            pair = Pair(*tokenize_pair(tokenizer, row, where))
            if pair.chosen == pair.rejected:
                raise ConfigError(f"{where}: 'chosen' and 'rejected' are the same completion; a preference pair needs "
                                  f"two different ones (drop the row)")
            if truncation_mode != "keep_start" or len(pair.prompt) < max_length:
                pairs.append(pair)
            else:
                dropped.append(number)
    if dropped and reports_data():  # one note per node, not one per rank
        print(f"note: dropped {len(dropped)} preference row(s) of {path} whose prompt alone fills --block_size "
              f"{max_length} (lines {', '.join(map(str, dropped[:5]))}{' ...' if len(dropped) > 5 else ''}), as TRL "
              f"does under keep_start truncation; raise --block_size or use --truncation_mode keep_end to keep them",
              file=sys.stderr)
    if not pairs:
        raise ConfigError(f"--train_file {path}: no preference row to train on (every prompt fills --block_size "
                          f"{max_length} under keep_start truncation, or the file is empty)")
    return pairs


def pair_rows(pairs: list[Pair], indices: list[int], pad_id: int, max_length: int, truncation_mode: str,
              multiple: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels [2 * pairs, length] of the pairs ``indices``: each pair's chosen row, then its rejected
    row (a split of the rows into even runs keeps pairs whole). A row is prompt + completion cut to ``max_length``
    as TRL's collator cuts it, labelled on the completion only, padded on the right (causal attention: the padding
    changes no real token's logits) to the longest row, rounded up to ``multiple`` (what the layout splits the
    sequence by), or to ``length`` where given (one shape for every batch)."""
    rows = []
    for i in indices:
        pair = pairs[i]
        for completion in (pair.chosen, pair.rejected):
            ids, labels = pair.prompt + completion, [IGNORE_INDEX] * len(pair.prompt) + completion
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            rows.append((ids[cut], labels[cut]))
    length = length or -(-max(len(ids) for ids, _ in rows) // multiple) * multiple
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, labs) in enumerate(rows):
        input_ids[row, :len(ids)], labels[row, :len(labs)] = torch.tensor(ids), torch.tensor(labs)
    return input_ids, labels


def real_tokens(labels: torch.Tensor) -> torch.Tensor:
    """1 on each row's real tokens, 0 on its right padding [rows, seq]: a row is prompt | completion | padding, its
    last labelled position its last real token (the attention mask TRL's collator gives the model)."""
    positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    last = torch.where(labels != IGNORE_INDEX, positions, -1).amax(dim=1, keepdim=True)
    return (positions <= last).long()


DOC = 1 << 44  # in a packed row, a label plus DOC x (its document's index + 1): which document each token is of


def pack_pairs(ids: torch.Tensor, labels: torch.Tensor, pad_id: int, capacity: int, multiple: int,
               rows_multiple: int = 1, length: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Preference rows (``pair_rows``: a pair's chosen row, then its rejected one, right-padded) packed, for
    ``--packing``: each pair's two rows back to back in one packed row, pairs in order, a new packed row where the next
    pair would pass ``capacity`` tokens. Rows as long as the longest (rounded up to ``multiple``) or ``length``, as
    many as a multiple of ``rows_multiple`` (empty rows added). Position ids restart at each document, so attention
    stays within it; each label carries its document's index (``DOC``), and a document's first token has none (its
    own row's shift drops it: no token predicts it across a boundary). Returns (ids, labels, position ids, the
    documents of each packed row)."""
    lengths = real_tokens(labels).sum(dim=1).tolist()
    groups: list[list[int]] = [[]]
    used = 0
    for first in range(0, len(lengths), 2):
        need = lengths[first] + lengths[first + 1]
        if groups[-1] and used + need > capacity:
            groups.append([])
            used = 0
        groups[-1] += [first, first + 1]
        used += need
    longest = max(sum(lengths[i] for i in group) for group in groups)
    width = length or -(-longest // multiple) * multiple
    groups += [[] for _ in range(-len(groups) % rows_multiple)]
    out_ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    out_labels = torch.full((len(groups), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    for row, group in enumerate(groups):
        at = 0
        for doc in group:
            n = lengths[doc]
            carried = labels[doc, :n]
            out_ids[row, at:at + n] = ids[doc, :n]
            out_labels[row, at:at + n] = torch.where(carried != IGNORE_INDEX, carried + DOC * (doc + 1), IGNORE_INDEX)
            out_labels[row, at] = IGNORE_INDEX
            positions[row, at:at + n] = torch.arange(n)
            at += n
    return out_ids, out_labels, positions, groups
