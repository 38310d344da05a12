"""The adapter registry: pluggy plugin manager, entry-point loading, validation, and architecture lookup.

Like tox's plugin manager, the core never touches ``pm.hook`` directly: ``Registry`` has one method per
hook it needs, and calls the hook on the single adapter that serves the model's architecture.

Precedence: an explicit adapter claiming the architecture always serves it; otherwise the one generic
adapter (``AdapterInfo.generic``, e.g. plait-transformers) serves it unless its ``plait_refusal`` says why
it cannot. Two explicit adapters claiming one architecture, or two generic adapters, are an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pluggy

from plait.plugin import hookspecs
from plait.plugin.declarations import AdapterInfo, PipelinePlan
from plait.tp.plans import SPPlan, TPPlan

ENTRY_POINT_GROUP = "plait.adapters"
DISABLE_AUTOLOAD_ENV = "PLAIT_DISABLE_PLUGIN_AUTOLOAD"
BLOCKED_ENV = "PLAIT_BLOCKED_ADAPTERS"
REQUIRED_HOOKS = ("plait_adapter_info", "plait_tp_plan", "plait_leaf_modules")


class AdapterError(RuntimeError):
    """A plugin problem: a missing hook, a duplicate claim, or an architecture nobody claims."""


@dataclass
class Adapter:
    """One loaded adapter: its info, the plugin object, and the distribution it came from."""

    info: AdapterInfo
    plugin: Any
    distribution: str | None
    version: str | None

    @property
    def name(self) -> str:
        return self.info.name

    def hooks(self, pm: pluggy.PluginManager) -> list[str]:
        return sorted(caller.name for caller in pm.get_hookcallers(self.plugin) or [])


class Registry:
    """Loads adapters and answers, for a model config, which adapter handles it and what its plans are."""

    def __init__(self, autoload: bool | None = None) -> None:
        self.pm = pluggy.PluginManager("plait")
        self.pm.add_hookspecs(hookspecs)
        self._adapters: dict[str, Adapter] = {}
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("1", "true", "yes")
        if autoload:
            self.load_entry_points()

    # -- loading ---------------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        """Let pluggy load the ``plait.adapters`` entry points, skipping the names blocked by
        ``PLAIT_BLOCKED_ADAPTERS``, then hold each loaded plugin to the checks ``register`` makes.

        pluggy registers plugins as it loads them, so the checks run afterwards, in load order; a plugin
        that fails them is unregistered and the error raised, as ``register`` does.
        """
        for name in _blocked_names():
            self.pm.set_blocked(name)
        self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        for plugin, dist in self.pm.list_plugin_distinfo():
            self._admit(plugin, dist.project_name, dist.version)

    def register(self, plugin: Any, distribution: str | None = None, version: str | None = None) -> Adapter:
        """Register an adapter object or module (tests and notebooks call this directly)."""
        if self.pm.register(plugin) is None:
            raise AdapterError(f"adapter {_label(plugin, distribution)} is blocked by {BLOCKED_ENV}")
        return self._admit(plugin, distribution, version)

    def _admit(self, plugin: Any, distribution: str | None, version: str | None) -> Adapter:
        """Check a plugin pluggy has registered and record it as an adapter; unregister it when it fails."""
        try:
            self._check_required_hooks(plugin, distribution)
            self.pm.check_pending()
            info = self._call(plugin, "plait_adapter_info")
            if not isinstance(info, AdapterInfo):
                raise AdapterError(f"adapter {_label(plugin, distribution)}: plait_adapter_info must return AdapterInfo")
            if info.capabilities.sp and not self._implements(plugin, "plait_sp_plan"):
                raise AdapterError(f"adapter {info.name!r} declares the sp capability but has no plait_sp_plan hook")
            if info.generic and not self._implements(plugin, "plait_refusal"):
                raise AdapterError(f"adapter {info.name!r} is generic but has no plait_refusal hook saying what it "
                                   f"cannot serve; implement it (see plait.plugin.hookspecs)")
            adapter = Adapter(info, plugin, distribution, version)
            self._check_claims(adapter)
        except Exception:
            self.pm.unregister(plugin)
            raise
        self._adapters[info.name] = adapter
        return adapter

    def _check_required_hooks(self, plugin: Any, distribution: str | None) -> None:
        missing = [hook for hook in REQUIRED_HOOKS if not self._implements(plugin, hook)]
        if missing:
            raise AdapterError(
                f"adapter {_label(plugin, distribution)} does not implement required hook(s) {', '.join(missing)}; "
                f"see plait.plugin.hookspecs for what each must return"
            )

    def _implements(self, plugin: Any, hook: str) -> bool:
        """True when ``plugin`` has ``hook`` decorated with ``@plait.hookimpl``."""
        return hasattr(plugin, hook) and self.pm.parse_hookimpl_opts(plugin, hook) is not None

    def unregister(self, name: str) -> None:
        adapter = self._adapters.pop(name)
        self.pm.unregister(adapter.plugin)

    def _check_claims(self, new: Adapter) -> None:
        """Explicit adapters may not share an architecture, nor two generic adapters coexist: either would
        leave the choice of adapter to load order."""
        for old in self._adapters.values():
            shared = sorted(set(old.info.architectures) & set(new.info.architectures))
            if old.info.generic and new.info.generic and old.name != new.name:
                raise AdapterError(
                    f"two generic adapters are installed: {old.name!r} (from {old.distribution or 'in-process'}) and "
                    f"{new.name!r} (from {new.distribution or 'in-process'}); uninstall one, or block one with "
                    f"{BLOCKED_ENV}={new.name}"
                )
            if shared or old.name == new.name:
                raise AdapterError(
                    f"architecture(s) {shared or [new.name]} claimed by two adapters: {old.name!r} "
                    f"(from {old.distribution or 'in-process'}) and {new.name!r} (from {new.distribution or 'in-process'}); "
                    f"uninstall one, or block one with {BLOCKED_ENV}={new.name}"
                )

    # -- lookup ----------------------------------------------------------------------------------
    @property
    def adapters(self) -> list[Adapter]:
        return sorted(self._adapters.values(), key=lambda a: a.name)

    def resolve(self, config: Any) -> Adapter:
        """The adapter serving ``config``: the explicit one claiming ``config.model_type`` or one of
        ``config.architectures``, else the generic adapter unless it refuses the model."""
        adapter, why = self.explain(config)
        if adapter is not None:
            return adapter
        installed = ", ".join(f"{a.name} ({', '.join(a.info.architectures) or 'generic'})" for a in self.adapters)
        model_type = getattr(config, "model_type", None)
        raise AdapterError(
            f"no plait adapter claims architecture {model_type!r}; installed adapters: {installed or 'none'}. "
            f"{why[:1].upper() + why[1:] + '. ' if why else ''}Install plait-{model_type} if that distribution exists, or another adapter that claims it; or "
            f"write one (docs/writing-an-adapter.md) and install it or register it with plait.register()"
        )

    def explain(self, config: Any) -> tuple[Adapter | None, str]:
        """(the adapter serving ``config`` or None, why): an explicit claim wins over the generic adapter,
        which serves what it does not refuse."""
        keys = [getattr(config, "model_type", None), *(getattr(config, "architectures", None) or [])]
        for adapter in self._adapters.values():
            if not adapter.info.generic and any(key in adapter.info.architectures for key in keys if key):
                return adapter, f"claimed by the explicit adapter {adapter.name!r}"
        generic = next((a for a in self._adapters.values() if a.info.generic), None)
        if generic is None:
            return None, ""
        refusal = self._call(generic.plugin, "plait_refusal", config=config)
        if refusal:
            return None, f"the generic adapter {generic.name!r} does not serve it: {refusal}"
        return generic, f"no explicit adapter claims it; the generic adapter {generic.name!r} derives its plans"

    # -- hooks, one typed method each ------------------------------------------------------------
    def tp_plan(self, adapter: Adapter, config: Any) -> TPPlan:
        return self._call(adapter.plugin, "plait_tp_plan", config=config)

    def sp_plan(self, adapter: Adapter, config: Any) -> SPPlan:
        return self._call(adapter.plugin, "plait_sp_plan", config=config)

    def pipeline_plan(self, adapter: Adapter, config: Any) -> PipelinePlan | None:
        return self._call(adapter.plugin, "plait_pipeline_plan", config=config)

    def leaf_modules(self, adapter: Adapter, config: Any) -> list[str]:
        return list(self._call(adapter.plugin, "plait_leaf_modules", config=config))

    def tiny_config(self, adapter: Adapter, architecture: str | None = None) -> Any:
        """The adapter's small config (of ``architecture``, for a generic adapter) for conformance tests, or
        None when it has no ``plait_tiny_config``."""
        return self._call(adapter.plugin, "plait_tiny_config", architecture=architecture)

    def init_weight(self, adapter: Adapter, **kwargs: Any) -> bool:
        return bool(self._call(adapter.plugin, "plait_init_weight", **kwargs))

    def implements(self, adapter: Adapter, hook: str) -> bool:
        """Whether ``adapter`` implements ``hook`` (lets the core skip work an absent hook would not use)."""
        return any(impl.plugin is adapter.plugin for impl in getattr(self.pm.hook, hook).get_hookimpls())

    def _call(self, plugin: Any, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of ``hook`` with the arguments it declares (None if absent)."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin is plugin:
                return impl.function(**{name: kwargs[name] for name in impl.argnames})
        return None


def served_architectures(registry: Registry) -> list[tuple[str, str | None, str]]:
    """(model_type, serving adapter's name or None, why) for every causal-LM architecture of the installed
    transformers, and every architecture an explicit adapter claims besides (``plait adapters --architectures``)."""
    from types import SimpleNamespace

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    claimed = {arch for a in registry.adapters for arch in a.info.architectures if arch.islower()}
    rows = []
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | claimed):
        class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        config = SimpleNamespace(model_type=model_type, architectures=[class_name] if class_name else None)
        adapter, why = registry.explain(config)
        rows.append((model_type, adapter.name if adapter else None, why or "no adapter claims it"))
    return rows


def _blocked_names() -> list[str]:
    """The entry-point names listed, comma-separated, in ``PLAIT_BLOCKED_ADAPTERS``."""
    return [name.strip() for name in os.environ.get(BLOCKED_ENV, "").split(",") if name.strip()]


def _label(plugin: Any, distribution: str | None) -> str:
    name = getattr(plugin, "__name__", type(plugin).__name__)
    return f"{name!r}" + (f" (from {distribution})" if distribution else "")


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry, loading entry points on first use."""
    global _default
    if _default is None:
        _default = Registry()
    return _default


def register(plugin: Any) -> Adapter:
    """Register an in-process adapter with the default registry (tests, notebooks)."""
    return default_registry().register(plugin)
