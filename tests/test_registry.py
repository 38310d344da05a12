"""The adapter registry: entry points, blocking, validation messages, and lookup."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

from plait import AdapterError, AdapterInfo, Registry, TPPlan, hookimpl
import plait
from plait.plugin import registry as registry_module


def make_adapter(name: str, architectures: tuple[str, ...], leaf: bool = True, sp: bool = False):
    """A minimal in-process adapter module (sp capability off unless asked, so no SP plan is needed)."""
    module = types.ModuleType(f"fake_{name}")

    @hookimpl
    def plait_adapter_info():
        return AdapterInfo(name, architectures, plait.Capabilities(sp=sp))

    @hookimpl
    def plait_tp_plan(config):
        return TPPlan(())

    module.plait_adapter_info = plait_adapter_info
    module.plait_tp_plan = plait_tp_plan
    if leaf:
        @hookimpl
        def plait_leaf_modules(config):
            return ["model.layers.*"]

        module.plait_leaf_modules = plait_leaf_modules
    return module


class FakeEntryPoint:
    """One ``plait.adapters`` entry point, alone in a distribution of its own (what pluggy's loader reads)."""

    group = registry_module.ENTRY_POINT_GROUP

    def __init__(self, name: str, module, dist_name: str) -> None:
        self.name, self._module = name, module
        self.dist = types.SimpleNamespace(metadata={"name": dist_name}, version="9.9", entry_points=[self])

    def load(self):
        return self._module


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the installed distributions with those of the entry points the test fills."""
    eps: list[FakeEntryPoint] = []
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [ep.dist for ep in eps])
    return eps


def test_builtin_adapters_load_through_entry_points():
    names = {a.name: a for a in Registry().adapters}
    assert {"llama", "gpt2", "mistral"} <= set(names)
    assert names["gpt2"].distribution == "plait-gpt2"



def test_entry_point_adapter_resolves(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("foo", make_adapter("foo", ("foo",)), "plait-foo"))
    registry = Registry()
    adapter = registry.resolve(types.SimpleNamespace(model_type="foo"))
    assert (adapter.name, adapter.distribution, adapter.version) == ("foo", "plait-foo", "9.9")


def test_resolve_by_class_name(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("foo", make_adapter("foo", ("FooForCausalLM",)), "plait-foo"))
    config = types.SimpleNamespace(model_type="other", architectures=["FooForCausalLM"])
    assert Registry().resolve(config).name == "foo"


def test_duplicate_claim_names_both_distributions(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("a", make_adapter("a", ("llama",)), "plait-a"))
    fake_entry_points.append(FakeEntryPoint("b", make_adapter("b", ("llama", "x")), "plait-b"))
    with pytest.raises(AdapterError) as err:
        Registry()
    message = str(err.value)
    assert "plait-a" in message and "plait-b" in message and "PLAIT_BLOCKED_ADAPTERS=b" in message
    assert "['llama']" in message


def test_blocked_adapter_is_skipped(fake_entry_points, monkeypatch):
    fake_entry_points.append(FakeEntryPoint("a", make_adapter("a", ("llama",)), "plait-a"))
    fake_entry_points.append(FakeEntryPoint("b", make_adapter("b", ("llama",)), "plait-b"))
    monkeypatch.setenv("PLAIT_BLOCKED_ADAPTERS", "b, other")
    assert [a.name for a in Registry().adapters] == ["a"]


def test_autoload_can_be_disabled(fake_entry_points, monkeypatch):
    fake_entry_points.append(FakeEntryPoint("a", make_adapter("a", ("a",)), "plait-a"))
    monkeypatch.setenv("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert Registry().adapters == []


def test_missing_required_hook(fake_entry_points):
    fake_entry_points.append(FakeEntryPoint("a", make_adapter("a", ("a",), leaf=False), "plait-a"))
    with pytest.raises(AdapterError, match=r"'fake_a' \(from plait-a\) does not implement required hook\(s\) plait_leaf_modules"):
        Registry()


def test_sp_capability_requires_sp_plan():
    with pytest.raises(AdapterError, match="declares the sp capability but has no plait_sp_plan"):
        Registry(autoload=False).register(make_adapter("a", ("a",), sp=True))


def test_misspelt_hook_is_refused():
    module = make_adapter("a", ("a",))

    @hookimpl
    def plait_tp_plans(config):  # typo: not a hook of the spec
        return None

    module.plait_tp_plans = plait_tp_plans
    with pytest.raises(Exception, match="plait_tp_plans"):
        Registry(autoload=False).register(module)


def test_unknown_architecture_lists_installed_adapters():
    registry = Registry()
    with pytest.raises(AdapterError) as err:
        registry.resolve(types.SimpleNamespace(model_type="bert", architectures=None))
    message = str(err.value)
    assert "'bert'" in message and "llama (llama, LlamaForCausalLM)" in message and "plait.register()" in message


def test_unknown_builtin_architecture_names_the_package():
    registry = Registry(autoload=False)
    with pytest.raises(AdapterError, match="Install plait-gpt2"):
        registry.resolve(types.SimpleNamespace(model_type="gpt2"))


def test_in_process_register_and_unregister():
    registry = Registry(autoload=False)
    registry.register(make_adapter("mine", ("mine",)))
    assert registry.resolve(types.SimpleNamespace(model_type="mine")).name == "mine"
    registry.unregister("mine")
    with pytest.raises(AdapterError):
        registry.resolve(types.SimpleNamespace(model_type="mine"))


def test_optional_hook_absent_returns_none():
    registry = Registry(autoload=False)
    adapter = registry.register(make_adapter("mine", ("mine",)))
    assert registry.pipeline_plan(adapter, config=None) is None
    assert registry.leaf_modules(adapter, config=None) == ["model.layers.*"]
