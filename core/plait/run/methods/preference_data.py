"""Preference data as TRL 1.16's DPOTrainer reads and tokenizes it, so that a recipe moved from TRL trains on the
same token ids: rows of ``prompt``, ``chosen`` and ``rejected``, plain text or conversational (lists of
``{"role", "content"}`` messages rendered with the tokenizer's chat template), or without ``prompt`` (the implicit
form: the prompt is what chosen and rejected share at their start).

TRL's rules, kept as they are: a plain completion gets the tokenizer's EOS appended unless it ends with it; the
prompt and each prompt+completion are tokenized whole, and the completion starts where the prompt's ids and the
prompt+completion's ids first differ (a chat template may render the prompt alone differently; tokens may merge
across the boundary); the implicit prompt is cut by TRL's ``extract_prompt``, quirks included (a space before the
cut stays with the completion; completions that are prefixes of each other cut one element early).
tests/test_preference_data.py holds every form to TRL's own preprocessing.
"""

from __future__ import annotations

from typing import Any

from plait.base.config import ConfigError

KEYS = ("prompt", "chosen", "rejected")


def is_conversational(example: dict[str, Any]) -> bool:
    """Whether the row's texts are lists of chat messages (TRL's test: the first message has a role)."""
    value = next((example[key] for key in KEYS if key in example), None)
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


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
