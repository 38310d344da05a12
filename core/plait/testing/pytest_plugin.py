"""pytest support for adapter packages: their whole parity suite is one line.

    from plait.testing import assert_conformance

    def test_conformance():
        assert_conformance("qwen2")          # an installed adapter's name, or an importable module

Or, with ``pytest_plugins = ["plait.testing.pytest_plugin"]`` in the package's root conftest.py, the
session fixture ``plait_conformance`` runs the kit once per (adapters, modes) and hands the same results to
every test that asks, so tests parametrized per mode share the launches.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from types import ModuleType

import pytest

from plait.testing.conformance import ModeResult, adapter_ref, render_table, run_conformance


def format_results(results: Sequence[ModeResult]) -> str:
    """The conformance table as plain text (for assertion messages)."""
    from rich.console import Console

    buffer = io.StringIO()
    render_table(results, Console(file=buffer, width=200, no_color=True, force_terminal=False))
    return buffer.getvalue()


def assert_conformance(*adapters: str | ModuleType, modes: Sequence[str] | None = None) -> list[ModeResult]:
    """Run the conformance kit on ``adapters``; raise AssertionError, with the table, if any mode fails.
    Skipped modes (a plait feature or adapter capability absent) do not fail. Returns the results."""
    results = run_conformance(adapters, modes)
    failed = [f"{r.adapter} {r.mode}" for r in results if r.failed]
    if failed:
        raise AssertionError(f"conformance failed for {', '.join(failed)}:\n{format_results(results)}")
    return results


@pytest.fixture(scope="session")
def plait_conformance() -> Callable[..., dict[tuple[str, str], ModeResult]]:
    """``plait_conformance(*adapters, modes=None, dtype="float32")`` -> {(adapter name, mode name): ModeResult},
    run once per distinct argument list in the session."""
    cache: dict[tuple, dict[tuple[str, str], ModeResult]] = {}

    def run(*adapters: str | ModuleType, modes: Sequence[str] | None = None,
            dtype: str = "float32") -> dict[tuple[str, str], ModeResult]:
        key = (tuple(adapter_ref(a) for a in adapters), tuple(modes or ()), dtype)
        if key not in cache:
            cache[key] = {(r.adapter, r.mode): r for r in run_conformance(adapters, modes, dtype=dtype)}
        return cache[key]

    return run
