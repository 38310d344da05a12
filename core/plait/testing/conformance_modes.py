"""The conformance kit's table of parallel modes, and how it finds the adapter under test.

A mode is one ``Row`` in ``ROWS``: the world size, the ParallelConfig, model config overrides, the plait
features it needs (detected by presence in the installed plait, so rows for features not merged yet read
"skipped: requires <feature>"), and a check that the adapter's tiny config can express it. The worker
runs every row the same way: parallelize, 3 steps through ``train_step`` (or forward + backward), the
optimizer the layout asks for, gradients compared shard by shard, then the row's ``after`` check.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from plait.config import ConfigError
from plait.tp.styles import Attention
from plait.registry import Adapter, AdapterError, Registry

STEPS, LR, ADAM_EPS, BATCH, SEQ = 3, 1e-3, 1e-6, 4, 16  # BATCH: sequences per data-parallel rank and step
LOSS_RTOL, RTOL, ATOL = 1e-5, 1e-5, 1e-6


# --------------------------------------------------------------------------------------------------
# Features: parts of plait a row needs, detected by their presence in the installed plait
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Feature:
    """A plait feature, present when ``module`` imports and has ``attr`` (``Class.attr`` paths allowed)."""

    name: str
    module: str
    attr: str

    def present(self) -> bool:
        try:
            obj: Any = importlib.import_module(self.module)
        except ImportError:
            return False
        for part in self.attr.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True


PIPELINE = Feature("pipeline parallelism (ParallelModel.train_step)", "plait.parallelize", "ParallelModel.train_step")
ZERO_1 = Feature("ZeRO-1 (plait.optim.build_optimizer)", "plait.optim", "build_optimizer")
CHECKPOINTS = Feature("checkpoints and consolidate (plait.checkpoint)", "plait.checkpoint", "consolidate")
RECOMPUTE = Feature("activation checkpointing (ParallelConfig.gradient_checkpointing)", "plait.config",
                    "ParallelConfig.gradient_checkpointing")


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Subject:
    """One adapter under test: its registry (holding only it), the adapter, and its tiny config."""

    ref: str
    registry: Registry
    adapter: Adapter
    config: Any

    @property
    def name(self) -> str:
        return self.adapter.name


def _has_tie_option(subject: Subject) -> str | None:
    if not hasattr(subject.config, "tie_word_embeddings"):
        return f"{type(subject.config).__name__} has no tie_word_embeddings"
    return None


def _kv_heads_fewer_than(tp: int) -> Callable[[Subject], str | None]:
    def check(subject: Subject) -> str | None:
        rules = [r for r in subject.registry.tp_plan(subject.adapter, subject.config).rules if isinstance(r, Attention)]
        kv = sorted({r.num_kv_heads for r in rules})
        if not any(n < tp for n in kv):
            return f"the tiny config has no attention with fewer kv heads than tp={tp} (kv heads: {kv or 'none'})"
        return _plan_fits(subject, tp)

    return check


def _plan_fits(subject: Subject, tp: int) -> str | None:
    """None when the TP plan splits the tiny model over ``tp`` ranks, else plait's reason why not."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.tp.sharding import plan_tensor_parallel

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(subject.config)
    plan = subject.registry.tp_plan(subject.adapter, subject.config)
    try:
        for rank in range(tp):
            plan_tensor_parallel(model, plan, tp, rank)
    except ConfigError as err:
        return f"tp={tp} does not fit the tiny config: {err}"
    return None


@dataclass(frozen=True)
class Row:
    """One parallel mode: the world it needs, the ParallelConfig, model config overrides, the plait features
    it needs, a check that the adapter's tiny config can express it, and an extra check after training."""

    name: str
    world: int
    layout: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    requires: tuple[Feature, ...] = ()
    applies: Callable[[Subject], str | None] | None = None
    after: str | None = None  # "consolidate": save, consolidate and reload the trained model

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.layout.items()] + [f"{k}={v}" for k, v in self.model.items()]
        return " ".join(parts)


PP2 = dict(pp=2, num_microbatches=4)
ROWS: dict[str, Row] = {row.name: row for row in (
    Row("tp2-sp", 2, dict(tp=2, sp=True)),
    Row("tp2", 2, dict(tp=2, sp=False)),
    Row("tp2-sp-tied", 2, dict(tp=2, sp=True), model=dict(tie_word_embeddings=True), applies=_has_tie_option),
    Row("tp4-kv-replicated", 4, dict(tp=4, sp=True), applies=_kv_heads_fewer_than(4)),
    Row("dp2", 2, dict(tp=1)),
    Row("pp2-1f1b", 2, {**PP2, "pipeline_schedule": "1f1b"}, requires=(PIPELINE,)),
    Row("pp2-interleaved-v2", 2, {**PP2, "pipeline_schedule": "interleaved-1f1b", "virtual_pipeline_size": 2},
        requires=(PIPELINE,)),
    Row("zero1-dp2", 2, dict(zero_1=True), requires=(ZERO_1,)),
    Row("tp2-sp-recompute", 2, dict(tp=2, sp=True, gradient_checkpointing=True), requires=(RECOMPUTE,)),
    Row("consolidate-tp2", 2, dict(tp=2, sp=True), requires=(CHECKPOINTS,), after="consolidate"),
)}


# --------------------------------------------------------------------------------------------------
# Adapters: by installed name, or by an importable module path (in-process and out-of-tree plugins)
# --------------------------------------------------------------------------------------------------


def adapter_ref(adapter: str | ModuleType) -> str:
    """The string the worker processes load ``adapter`` from: an installed name or a module path."""
    if isinstance(adapter, ModuleType):
        return adapter.__name__
    return adapter


def load_subject(ref: str) -> Subject:
    """A registry holding only the adapter ``ref`` names, so an adapter that claims the same architecture
    as an installed one (a fork, a deliberately broken copy) is tested on its own.

    ``ref``: the name of an installed adapter (``plait adapters``), or an importable module holding hooks.
    """
    installed = Registry()
    found = next((a for a in installed.adapters if a.name == ref), None)
    registry = Registry(autoload=False)
    if found is not None:
        adapter = registry.register(found.plugin, found.distribution, found.version)
    else:
        try:
            module = importlib.import_module(ref)
        except ImportError as err:
            names = ", ".join(a.name for a in installed.adapters) or "none"
            raise AdapterError(
                f"no installed adapter is named {ref!r} and it is not an importable module ({err}); installed "
                f"adapters: {names}"
            ) from err
        adapter = registry.register(module)
    config = registry.tiny_config(adapter)
    if config is None:
        raise AdapterError(
            f"adapter {adapter.name!r} does not implement plait_tiny_config; implement it to return a small "
            f"transformers config of its architecture (a few layers, hidden 32-64, vocab ~60-130) so the "
            f"conformance kit can build a test model (see plait.hookspecs.plait_tiny_config)"
        )
    return Subject(ref, registry, adapter, config)


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """A copy of a transformers config with ``overrides`` set."""
    config = config.__class__.from_dict(config.to_dict())
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
