"""Module-name patterns as adapters write them: dotted paths where ``*`` matches exactly one component
(``model.layers.*.mlp.up_proj``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from torch import nn

from plait.base.config import ConfigError


@lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern[str]:
    parts = [r"[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def matches(pattern: str, name: str) -> bool:
    """True when the dotted module ``name`` matches ``pattern`` (``*`` = one path component)."""
    return _compile(pattern).match(name) is not None


def leaf_module_names(model: nn.Module, patterns: Sequence[str], feature: str) -> list[str]:
    """Names of ``model``'s modules matching one of the adapter's leaf ``patterns``, for ``feature`` (what uses
    them: activation checkpointing, torch.compile). Raises ConfigError when none matches: an adapter whose leaf
    patterns do not fit the model would otherwise silently run without the feature."""
    names = [name for name, _ in model.named_modules() if any(matches(p, name) for p in patterns)]
    if not names:
        raise ConfigError(
            f"{feature}: no module of {type(model).__name__} matches the adapter's leaf modules {list(patterns)}; "
            f"fix the adapter's plait_leaf_modules or turn {feature} off"
        )
    return names
