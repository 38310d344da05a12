"""The lines of SFT .jsonl files: which format a file is in, and each line checked and put in one shape.

Formats: chat (``messages``, or ShareGPT's ``conversations``) and prompt_completion (``prompt`` +
``completion``); anything else is plain text, read by ``plait.data.sources``. A chat line comes out as
``{"messages": [{"role": ..., "content": ...}, ...]}`` whichever it came in as, so a ShareGPT file tokenizes
to exactly the ids and labels of the same conversations written as ``messages`` (the cache key's format is
"chat" for both: a change to ``SHAREGPT_ROLES`` must change ``sft.CACHE_FORMAT``).

A bad line is one error naming the file, the line and the field path (``messages[1].content``) with the
value found, so that a typo or a wrong type is found without opening the file. A first line with no known
format names the keys it has and the known ones they resemble (``'message'``: did you mean ``'messages'``?).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.base.config import ConfigError
from plait.data.sources import jsonl_lines, resolve_sources

ROLES = ("system", "developer", "user", "assistant", "tool")  # what chat templates render
# ShareGPT's ``from`` values, read as TRL (human, gpt) and axolotl (human/user, gpt/assistant) read them; the
# ShareGPT V3 dump names the assistant after the model that answered (chatgpt, bing, bard), Gemma's data "model".
# Tool results ("function" in OpenAI's older API, "observation" in LLaMA-Factory's) become the tool role.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
NEAR_MISS_CUTOFF = 0.75  # 'message', 'Messages', 'prompts', 'txt' match; 'context' (0.73 to 'text') does not


@dataclass(frozen=True)
class SFTSource:
    """Where SFT data comes from and how it is laid out in blocks: plain values, named as plait train's flags that
    fill them (``TrainArgs.sft_source``), which the data layer's messages name."""

    train_file: str | None = None
    validation_file: str | None = None
    dataset_name: str | None = None
    text_field: str = "text"
    data_format: str = "auto"
    tokenizer_name: str | None = None
    model_name_or_path: str | None = None
    train_on_prompt: bool = False
    block_size: int = 128
    packing: bool = False
    overlong: str = "truncate"
    data_cache_dir: str | None = None
    ddp_timeout: float = 600.0


def record_format(record: Any, text_field: str = "text") -> str | None:
    """chat, prompt_completion or text, from a parsed .jsonl line's fields; None for none of them."""
    if not isinstance(record, dict):
        return None
    if "messages" in record and "images" in record:  # TRL's vision format (plait.data.vision)
        return "vision"
    if "messages" in record or "conversations" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if text_field in record:
        return "text"
    return None


def data_format(source: SFTSource) -> str:
    """--data_format, or with ``auto`` the format of the first line of the first .jsonl training file
    (anything else is plain text).

    Raises:
        ConfigError: for a first line that is a JSON object with none of the formats' fields, naming the keys
            it has and the known ones they resemble.
        ValueError: for a file that cannot be read or is not UTF-8 (``jsonl_lines``: the file, line and byte).
    """
    if source.data_format != "auto":
        return source.data_format
    if source.dataset_name or not source.train_file:
        return "text"
    first = resolve_sources(source.train_file, source.text_field, "--train_file")[0]
    if first.kind != "jsonl":
        return "text"
    for line in jsonl_lines(first.path):
        try:
            record = json.loads(line.text)
        except ValueError as err:
            raise ConfigError(f"{first.path} line {line.number}: not valid JSON ({err})") from None
        fmt = record_format(record, source.text_field)
        if fmt is None and isinstance(record, dict):
            raise ConfigError(f"{first.path} line {line.number}: no 'messages', 'conversations', 'prompt'+'completion' "
                              f"or {source.text_field!r} field; found {_keys(record)}"
                              f"{_unknown_format_hint(record, source.text_field)}")
        return fmt or "text"  # not a JSON object: the text reader names the line
    return "text"


def _unknown_format_hint(record: dict, text_field: str) -> str:
    """What the user most likely meant by a line of no known format: the known keys its keys resemble, else
    the fix."""
    guesses = _did_you_mean(record, ("messages", "conversations", "prompt", "completion", text_field))
    if guesses:
        return f" ({guesses})"
    if ("prompt" in record) != ("completion" in record):
        return "; prompt/completion data needs both 'prompt' and 'completion'"
    return "; name the text field with --text_field, or give chat ('messages') or prompt/completion lines"


def _did_you_mean(record: dict, known: tuple[str, ...]) -> str:
    """"did you mean 'messages'?" for the keys of ``record`` that resemble one of ``known`` (case aside)
    without being it (difflib's ratio, as Python's own suggestions for misspelt names); '' for none."""
    lowered = {k.lower(): k for k in known}
    guesses = []
    for key in map(str, record):
        match = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=NEAR_MISS_CUTOFF)
        if match and key not in known:
            guesses.append((key, lowered[match[0]]))
    if not guesses:
        return ""
    if len(record) == 1:
        return f"did you mean {guesses[0][1]!r}?"
    return "; ".join(f"did you mean {want!r} for {got!r}?" for got, want in guesses)


def _keys(record: dict) -> str:
    return ", ".join(repr(str(k)) for k in record) or "no keys"


def read_records(path: Path, fmt: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line, each checked against ``fmt``; a chat record is
    ``{"messages": [...]}`` whether its line held ``messages`` or ShareGPT ``conversations``.

    Raises:
        ValueError: naming the file, the line and the field, for a line that is not JSON or not in ``fmt``; naming
            the file, line and byte offset for an unreadable, binary or non-UTF-8 file (``jsonl_lines``).
    """
    for line in jsonl_lines(path):
        where = f"{path} line {line.number}"
        try:
            record = json.loads(line.text)
        except ValueError as err:
            raise ValueError(f"{where}: not valid JSON ({err})") from None
        try:
            yield line.number, _normalized(record, fmt)
        except _LineError as err:
            raise ValueError(f"{where}: {err}") from None


class _LineError(Exception):
    """What is wrong with one line, without its file and line (``read_records`` adds them)."""


_EXPECTED = {"chat": "'messages': a list of {'role': ..., 'content': ...} with at least one assistant turn "
                     "(or ShareGPT 'conversations' of {'from': ..., 'value': ...})",
             "prompt_completion": "'prompt' and 'completion' strings"}


def _describe(value: Any) -> str:
    """``int (4)``: a value's JSON type (as Python names it) and the value, clipped."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False)
    return f"{type(value).__name__} ({text if len(text) <= 40 else text[:37] + '...'})"


def _missing(record: Any, what: str, fmt: str, known: tuple[str, ...]) -> _LineError:
    if not isinstance(record, dict):
        return _LineError(f"not a JSON object ({_describe(record)}); every line of a {fmt} file needs {_EXPECTED[fmt]}")
    guesses = _did_you_mean(record, known)
    return _LineError(f"no {what} (found {_keys(record)}{'; ' + guesses if guesses else ''}); every line of a {fmt} "
                      f"file needs {_EXPECTED[fmt]}, or choose another --data_format")


def _normalized(record: Any, fmt: str) -> dict:
    if fmt == "prompt_completion":
        if not (isinstance(record, dict) and "prompt" in record and "completion" in record):
            absent = [f"{f!r}" for f in ("prompt", "completion") if not isinstance(record, dict) or f not in record]
            raise _missing(record, " or ".join(absent), fmt, ("prompt", "completion"))
        for field in ("prompt", "completion"):
            _string(record[field], field)
        return record
    if not isinstance(record, dict) or not ("messages" in record or "conversations" in record):
        raise _missing(record, "'messages' or 'conversations' list", fmt, ("messages", "conversations"))
    key = "messages" if "messages" in record else "conversations"
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise _LineError(f"{key} is {_describe(turns)}, expected a non-empty list of "
                         f"{'{role, content}' if key == 'messages' else '{from, value}'} objects")
    messages = [_message(turn, f"{key}[{i}]", key) for i, turn in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise _LineError(f"no assistant message in {key} (roles: {roles}); chat data trains on the assistant turns")
    return record if key == "messages" else {"messages": messages}


def _message(turn: Any, path: str, key: str) -> dict:
    """One turn as {'role', 'content'}: a {'role', 'content'} entry as it is (its other keys kept for the
    template), a ShareGPT {'from', 'value'} converted (in either list, as TRL's ``maybe_convert_to_chatml``)."""
    if not isinstance(turn, dict):
        fields = "'role' and 'content'" if key == "messages" else "'from' and 'value'"
        raise _LineError(f"{path} is {_describe(turn)}, expected an object with {fields}")
    if "from" in turn and "role" not in turn:
        source = turn["from"]
        _string(source, f"{path}.from")
        if source not in SHAREGPT_ROLES:
            raise _LineError(f"{path}.from is {source!r}, not a ShareGPT role; expected one of "
                             f"{', '.join(SHAREGPT_ROLES)}")
        if "value" not in turn:
            raise _LineError(f"{path} has no 'value' (found {_keys(turn)})")
        _string(turn["value"], f"{path}.value")
        return {"role": SHAREGPT_ROLES[source], "content": turn["value"]}
    for field in ("role", "content"):
        if field not in turn:
            raise _LineError(f"{path} has no {field!r} (found {_keys(turn)}); a message is "
                             f"{{'role': ..., 'content': ...}}")
        _string(turn[field], f"{path}.{field}")
    if turn["role"] not in ROLES:
        raise _LineError(f"{path}.role is {turn['role']!r}; expected one of {', '.join(ROLES)}")
    return turn


def _string(value: Any, path: str) -> None:
    if not isinstance(value, str):
        raise _LineError(f"{path} is {_describe(value)}, expected a string")
