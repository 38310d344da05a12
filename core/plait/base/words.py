"""How a refusal names a setting: in ParallelConfig's (and peft LoraConfig's) words to a Python caller (``tp=1``),
in ``plait train``'s flags on the command line (``--tensor_parallel_size 1``).

The library raises the same errors for both callers; the ``plait`` command runs inside ``flag_words()``, and
``setting`` picks the words, so a user is told the fix in the language they wrote the mistake in.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

# The plait train flag of each field a refusal may name (plait.run.train_args defines them).
FLAGS = {
    "tp": "--tensor_parallel_size", "pp": "--pipeline_parallel_size", "cp": "--context_parallel_size",
    "ep": "--expert_parallel_size", "virtual_pipeline_size": "--virtual_pipeline_size",
    "num_microbatches": "--num_microbatches", "pipeline_schedule": "--pipeline_schedule", "zero_stage": "--zero_stage",
    "zero_1": "--zero_1", "float8": "--float8", "float8_emulate": "--float8_emulate", "cp_attention": "--cp_attention",
    "r": "--lora_r", "lora_dropout": "--lora_dropout", "target_modules": "--lora_target_modules",
    "target_parameters": "--lora_target_parameters",
}
UNSET = object()
_FLAG_WORDS: contextvars.ContextVar[bool] = contextvars.ContextVar("plait_flag_words", default=False)


@contextlib.contextmanager
def flag_words() -> Iterator[None]:
    """Within it, ``setting`` names plait train's flags (the ``plait`` command's own calls)."""
    token = _FLAG_WORDS.set(True)
    try:
        yield
    finally:
        _FLAG_WORDS.reset(token)


def setting(field: str, value: Any = UNSET) -> str:
    """``field`` (set to ``value``, when given) as the caller wrote it: ``tp=1`` / ``--tensor_parallel_size 1``,
    ``zero_1=True`` / ``--zero_1``, ``sp=False`` / ``--disable_sequence_parallel``, a list as ``['q_proj']`` /
    ``q_proj,v_proj``; a field without a flag keeps its name."""
    if not _FLAG_WORDS.get():
        return field if value is UNSET else f"{field}={value!r}"
    if field == "sp":
        return "--disable_sequence_parallel" if value is False else "no --disable_sequence_parallel"
    flag = FLAGS.get(field)
    if flag is None:
        return field if value is UNSET else f"{field}={value!r}"
    if value is UNSET or value is True:
        return flag
    if isinstance(value, (list, tuple, set)):
        return f"{flag} {','.join(map(str, sorted(value) if isinstance(value, set) else value))}"
    return f"{flag} {value}"


def setting_text(field: str, text: str) -> str:
    """``field`` set to ``text``, values written out already (``2 or 4``): ``tp=2 or 4`` / ``--tensor_parallel_size 2
    or 4``."""
    flag = FLAGS.get(field) if _FLAG_WORDS.get() else None
    return f"{field}={text}" if flag is None else f"{flag} {text}"


def no_effect(flags: list[str], why: str, fix: str = "") -> str:
    """The words of one refusal of ``flags`` given that do nothing: ``--a, --b have no effect{why}; drop them{fix}``
    (``why`` with its own lead: " without ...", ": ..."), one sentence for every such refusal."""
    several = len(flags) > 1
    return f"{', '.join(flags)} ha{'ve' if several else 's'} no effect{why}; drop {'them' if several else 'it'}{fix}"
