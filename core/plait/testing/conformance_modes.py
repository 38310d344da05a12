"""The conformance kit's table of parallel modes, and how it finds the adapter under test.

A mode is one ``Mode`` in ``MODES``: the world size, the ParallelConfig, model config overrides, and a
check that the adapter's tiny config can express it (answered by ``plan_layout``, the same refusals
``parallelize`` makes). The worker
runs every mode the same way: parallelize, 3 steps through ``train_step`` (or forward + backward), the
optimizer the layout asks for, gradients compared shard by shard, then the mode's ``after`` check.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.layout_plan import plan_layout
from plait.plugin.registry import Adapter, AdapterError, Registry
from plait.tp.styles import Attention

STEPS, LR, ADAM_EPS, BATCH, SEQ = 3, 1e-3, 1e-6, 4, 16  # BATCH: sequences per data-parallel rank and step
LOSS_RTOL, RTOL, ATOL = 1e-5, 1e-5, 1e-6


# --------------------------------------------------------------------------------------------------
# Modes
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
        """The adapter's name; ``adapter:architecture`` for one architecture of a generic adapter."""
        return self.ref if self.adapter.info.generic else self.adapter.name


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
    """None when the layout plan splits the tiny model over ``tp`` ranks, else plait's reason why not."""
    try:
        plan_layout(build_meta_model(subject.config), ParallelConfig(tp=tp), tp, subject.registry)
    except ConfigError as err:
        return f"tp={tp} does not fit the tiny config: {err}"
    return None


def _layout_fits(layout: dict[str, Any], world: int) -> Callable[[Subject], str | None]:
    """None when plait plans ``layout`` for the tiny model (cp: the model's mixers, masks and heads), else
    plait's reason why not."""

    def check(subject: Subject) -> str | None:
        try:
            plan_layout(build_meta_model(subject.config), ParallelConfig(**layout), world, subject.registry)
        except ConfigError as err:
            return str(err)
        return None

    return check


@dataclass(frozen=True)
class Mode:
    """One parallel mode: the world it needs, the ParallelConfig, model config overrides, a check that the
    adapter's tiny config can express it, an extra check after training, and one line saying what it proves."""

    name: str
    world: int
    layout: dict[str, Any]
    summary: str
    model: dict[str, Any] = field(default_factory=dict)
    applies: Callable[[Subject], str | None] | None = None
    after: str | None = None  # "consolidate": save, consolidate and reload the trained model
    # global-norm clipping (plait's OptimizerStep against torch's clip_grad_norm_ on the reference) at this fraction
    # of the reference's global norm of each step, so it bites at every step while the clipped gradients stay large
    # against the kit's absolute tolerance; over ``steps`` steps
    clip: float | None = None
    steps: int = STEPS

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.layout.items()] + [f"{k}={v}" for k, v in self.model.items()]
        if self.clip is not None:
            parts.append(f"clip={self.clip:g}x steps={self.steps}")
        return " ".join(parts)


PP2 = dict(pp=2, num_microbatches=4)
PP2_1F1B = {**PP2, "pipeline_schedule": "1f1b"}
TIED = dict(tie_word_embeddings=True)
CP2, CP2_RING, CP2_TP2 = dict(cp=2), dict(cp=2, cp_attention="ring"), dict(cp=2, tp=2, sp=True)
EP2, EP2_ZERO1, EP2_TP2, EP2_PP2 = dict(ep=2), dict(ep=2, zero_1=True), dict(ep=2, tp=2, sp=True), dict(ep=2, **PP2)
ZERO2, ZERO3 = dict(zero_stage=2, num_microbatches=2), dict(zero_stage=3)
CLIPPED = dict(clip=0.5, steps=4)
TP2_ZERO3, PP2_ZERO3 = dict(tp=2, sp=True, zero_stage=3), dict(**PP2_1F1B, zero_stage=3)
# Each capability's activation checkpointing, tied-embedding and consolidation variants run with and without
# sequence parallelism, so an adapter declaring tp without sp still has them proven.
MODES: dict[str, Mode] = {mode.name: mode for mode in (
    Mode("tp2-sp", 2, dict(tp=2, sp=True), "tensor parallel over 2 ranks with sequence parallelism"),
    Mode("tp2", 2, dict(tp=2, sp=False), "tensor parallel over 2 ranks, activations whole between the TP regions"),
    Mode("tp2-sp-tied", 2, dict(tp=2, sp=True), "tp2-sp with the input embedding and the LM head tied",
         model=TIED, applies=_has_tie_option),
    Mode("tp2-tied", 2, dict(tp=2, sp=False), "tp2 with the input embedding and the LM head tied",
         model=TIED, applies=_has_tie_option),
    Mode("tp4-kv-replicated", 4, dict(tp=4, sp=True), "tp=4 with fewer kv heads than ranks: kv heads replicated, "
         "their gradients summed", applies=_kv_heads_fewer_than(4)),
    Mode("dp2", 2, dict(tp=1), "data parallel over 2 ranks"),
    Mode("pp2-1f1b", 2, PP2_1F1B, "2 pipeline stages, 1F1B schedule, 4 microbatches"),
    Mode("pp2-interleaved-v2", 2, {**PP2, "pipeline_schedule": "interleaved-1f1b", "virtual_pipeline_size": 2},
         "2 pipeline ranks with 2 virtual stages each, interleaved 1F1B"),
    Mode("pp2-tied", 2, PP2_1F1B, "pp2-1f1b with the embedding and the head tied across the first and last stage",
         model=TIED, applies=_has_tie_option),
    Mode("zero1-dp2", 2, dict(zero_1=True), "ZeRO-1: optimizer state sharded over 2 data-parallel ranks"),
    Mode("zero2-dp2", 2, ZERO2, "ZeRO-2 (FSDP2): gradients and optimizer state sharded over 2 "
         "data-parallel ranks, 2 microbatches a step, 4 steps clipped", applies=_layout_fits(ZERO2, 2), **CLIPPED),
    Mode("zero3-dp2", 2, ZERO3, "ZeRO-3 (FSDP2): parameters too, gathered per decoder layer, 4 steps clipped",
         applies=_layout_fits(ZERO3, 2), **CLIPPED),
    Mode("tp2-zero3-dp2", 4, TP2_ZERO3, "tensor parallel 2 with SP x ZeRO-3 over 2 data-parallel ranks",
         applies=_layout_fits(TP2_ZERO3, 4)),
    Mode("pp2-zero3-dp2", 4, PP2_ZERO3, "2 pipeline stages (1F1B) x ZeRO-3 over 2 data-parallel ranks",
         applies=_layout_fits(PP2_ZERO3, 4)),
    Mode("consolidate-zero3-dp2", 2, ZERO3, "the consolidation round trip after zero3-dp2", after="consolidate",
         applies=_layout_fits(ZERO3, 2)),
    Mode("tp2-sp-recompute", 2, dict(tp=2, sp=True, gradient_checkpointing=True),
         "tp2-sp with activation checkpointing of the leaf modules"),
    Mode("tp2-recompute", 2, dict(tp=2, sp=False, gradient_checkpointing=True),
         "tp2 with activation checkpointing of the leaf modules"),
    Mode("pp2-recompute", 2, {**PP2_1F1B, "gradient_checkpointing": True},
         "pp2-1f1b with activation checkpointing of the leaf modules"),
    Mode("consolidate-tp2-sp", 2, dict(tp=2, sp=True), "tp2-sp, then save, consolidate to a from_pretrained "
         "directory and reload: every tensor equal to the trained shards", after="consolidate"),
    Mode("consolidate-tp2", 2, dict(tp=2, sp=False), "the consolidation round trip after tp2", after="consolidate"),
    Mode("consolidate-pp2", 2, PP2_1F1B, "the consolidation round trip after pp2-1f1b", after="consolidate"),
    Mode("cp2", 2, CP2, "context parallel over 2 ranks, the default attention strategy (all-to-all where it applies)",
         applies=_layout_fits(CP2, 2)),
    Mode("cp2-ring", 2, CP2_RING, "context parallel over 2 ranks, ring attention", applies=_layout_fits(CP2_RING, 2)),
    Mode("cp2-tp2", 4, CP2_TP2, "context parallel 2 x tensor parallel 2 with sequence parallelism",
         applies=_layout_fits(CP2_TP2, 4)),
    Mode("ep2", 2, EP2, "routed experts divided over 2 expert-parallel ranks", applies=_layout_fits(EP2, 2)),
    Mode("ep2-zero1", 2, EP2_ZERO1, "ep2 with ZeRO-1", applies=_layout_fits(EP2_ZERO1, 2)),
    Mode("ep2-tp2", 4, EP2_TP2, "ep2 x tensor parallel 2 with sequence parallelism", applies=_layout_fits(EP2_TP2, 4)),
    Mode("ep2-pp2", 4, EP2_PP2, "ep2 x 2 pipeline stages", applies=_layout_fits(EP2_PP2, 4)),
)}


def modes_help() -> str:
    """One line per mode, for ``plait check-adapter --help``."""
    width = max(len(name) for name in MODES)
    return "\n".join(f"  {mode.name:<{width}}  {mode.summary}" for mode in MODES.values())


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

    ``ref``: the name of an installed adapter (``plait adapters``), an importable module holding hooks, or
    ``ADAPTER:ARCHITECTURE`` for one architecture (``model_type``) of a generic adapter (``transformers:qwen3``).
    """
    name, _, architecture = ref.partition(":")
    installed = Registry()
    found = next((a for a in installed.adapters if a.name == name), None)
    registry = Registry(autoload=False)
    if found is not None:
        adapter = registry.register(found.plugin, found.distribution, found.version)
    else:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            names = ", ".join(a.name for a in installed.adapters) or "none"
            raise AdapterError(
                f"no installed adapter is named {name!r} and it is not an importable module ({err}); installed "
                f"adapters: {names}"
            ) from err
        adapter = registry.register(module)
    if adapter.info.generic != bool(architecture):
        raise AdapterError(
            f"adapter {adapter.name!r} is {'generic' if adapter.info.generic else 'not generic'}: name "
            + (f"one of its architectures as {adapter.name}:MODEL_TYPE (e.g. {adapter.name}:qwen3)"
               if adapter.info.generic else f"it as {adapter.name!r}, without an architecture")
        )
    config = registry.tiny_config(adapter, architecture or None)
    if config is None:
        raise AdapterError(
            f"adapter {adapter.name!r} does not implement plait_tiny_config; implement it to return a small "
            f"transformers config of its architecture (a few layers, hidden 32-64, vocab ~60-130) so the "
            f"conformance kit can build a test model (see plait.plugin.hookspecs.plait_tiny_config)"
        )
    return Subject(ref, registry, adapter, config)


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """A copy of a transformers config with ``overrides`` set."""
    config = config.__class__.from_dict(config.to_dict())
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
