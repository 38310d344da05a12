"""The data adapters return: what an architecture is, and how its modules parallelize.

Plans are plain frozen dataclasses. Adapters build them from a model config and never touch
torch.distributed; the core validates them against the model and applies them in one fixed order.
Module names are dotted paths as in ``model.named_modules()``; ``*`` matches exactly one path component
(``model.layers.*.mlp.up_proj``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

from torch import nn

from plait.config import ConfigError


@dataclass(frozen=True)
class Capabilities:
    """What the adapter has been proven to support; the core refuses other combinations before loading."""

    tp: bool = True
    sp: bool = True
    pp: bool = True
    vpp: bool = True
    tied_embeddings: bool = True

    def supported(self) -> list[str]:
        return [name for name, on in vars(self).items() if on]


@dataclass(frozen=True)
class AdapterInfo:
    """Returned by ``plait_adapter_info``: the name, the transformers ``model_type`` values (or model class
    names) the adapter claims, and its capabilities."""

    name: str
    architectures: tuple[str, ...]
    capabilities: Capabilities = field(default_factory=Capabilities)


class Style(str, Enum):
    COLUMN = "column"  # output features split; input replicated (or gathered from sequence shards)
    ROW = "row"  # input features split; partial outputs summed (or reduce-scattered to sequence shards)
    VOCAB_EMBEDDING = "vocab_embedding"  # rows (vocab) split, vocab padded to a multiple of tp
    VOCAB_HEAD = "vocab_head"  # the LM head, column-parallel over the (padded) vocab, feeding the parallel loss
    REPLICATED = "replicated"


@dataclass(frozen=True)
class Rule:
    """One module pattern and its style. Linear and transformers' Conv1D (a transposed linear) are both
    handled by the style."""

    pattern: str
    style: Style


def Column(pattern: str) -> Rule:
    return Rule(pattern, Style.COLUMN)


def Row(pattern: str) -> Rule:
    return Rule(pattern, Style.ROW)


def VocabEmbedding(pattern: str) -> Rule:
    return Rule(pattern, Style.VOCAB_EMBEDDING)


def VocabHead(pattern: str) -> Rule:
    return Rule(pattern, Style.VOCAB_HEAD)


@dataclass(frozen=True)
class Attention:
    """An attention block: which children project q, k, v (separately, or fused as ``qkv`` = q|k|v along
    the output features) and the output projection ``o``, plus head counts from the model config.

    The core splits heads over tp: q heads H/tp per rank; kv heads KV/tp per rank when KV >= tp, or one
    replicated kv head per rank when KV < tp (its gradient summed over the ranks sharing it).
    ``local_attrs`` names attributes of the attention module that transformers read from the config and
    that must hold per-rank values, mapped to one of: q_heads, kv_heads, kv_groups, q_width, kv_width.
    """

    pattern: str
    o: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    local_attrs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        named = [p is not None for p in (self.q, self.k, self.v)]
        if not (all(named) and self.qkv is None or not any(named) and self.qkv is not None):
            raise ValueError(f"Attention({self.pattern!r}) needs either q, k and v, or qkv (fused), not both")


@dataclass(frozen=True)
class TPPlan:
    """Returned by ``plait_tp_plan``: every module not matched stays replicated."""

    rules: tuple[Rule | Attention, ...]


@dataclass(frozen=True)
class SPPlan:
    """Returned by ``plait_sp_plan``: the sequence-parallel region.

    ``begin``: the module whose first input is split along the sequence (the first decoder layer, so that
    transformers has already built position ids, rotary tables and the causal mask from the full sequence).
    ``end``: the module whose output is gathered back (the final norm). ``norms``: patterns of every module
    with replicated parameters that runs on sequence shards inside the region (layer norms); their
    gradients are summed over tp so they stay equal on every rank.
    """

    begin: str
    end: str
    norms: tuple[str, ...]


@dataclass(frozen=True)
class PipelinePlan:
    """Returned by ``plait_pipeline_plan``: ``first`` modules run on the first stage (embeddings),
    ``layers`` is the container of repeated blocks split across stages, ``last`` modules run on the last
    stage (final norm, head); ``neutralize`` modules are replaced by no-ops on stages that do not own them
    (e.g. GPT2 position embeddings and embedding dropout): an ``nn.Embedding`` adds zero, anything else
    passes its input through. Parameter-free ``first``/``last`` modules (rotary tables) are not owned by
    one stage: every stage recomputes them."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    neutralize: tuple[str, ...] = ()


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
