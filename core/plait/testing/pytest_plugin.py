"""pytest support for adapter packages: their whole parity suite is one line.

    from plait.testing import assert_conformance

    def test_conformance():
        assert_conformance("qwen2")          # an installed adapter's name, or an importable module

Or, with ``pytest_plugins = ["plait.testing.pytest_plugin"]`` in the package's root conftest.py, the
session fixture ``plait_conformance`` runs the kit once per (adapters, modes) and hands the same results to
every test that asks, so tests parametrized per mode share the launches. Pairs beyond a cross product
(``pairs=``: a few modes of some adapters only) join the same launches: one world per size for all of them.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from types import ModuleType

import pytest

from plait.base.config import ConfigError
from plait.testing.conformance import (
    DTYPES, ModeResult, _run_world, _skip_reason, adapter_ref, recheck_float64, render_table, run_conformance,
    select_modes,
)
from plait.testing.conformance_modes import Mode, Subject, load_subject


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


def run_conformance_pairs(
    pairs: Sequence[tuple[str | ModuleType, str]], *, dtype: str = "float32", timeout: float | None = None,
    subjects: dict[str, Subject] | None = None, recheck: bool = True,
) -> list[ModeResult]:
    """``run_conformance`` for chosen (adapter, mode name) pairs instead of every mode of every adapter: the same
    skips, the same float64 recheck of noise-shaped fp32 misses (``recheck``), and one launch per world size for all
    of them (and a fresh one after a pair that broke its world). ``subjects``: adapters already loaded, by reference
    (filled in with those loaded here)."""
    if dtype not in DTYPES:
        raise ConfigError(f"conformance dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    subjects = {} if subjects is None else subjects
    wanted: list[tuple[Subject, Mode]] = []
    for adapter, mode_name in dict.fromkeys((adapter_ref(a), m) for a, m in pairs):
        if adapter not in subjects:
            subjects[adapter] = load_subject(adapter)
        wanted.append((subjects[adapter], select_modes([mode_name])[0]))
    results: dict[tuple[str, str], ModeResult] = {}
    runs: dict[int, list[tuple[Subject, Mode]]] = {}
    for subject, mode in wanted:
        reason = _skip_reason(subject, mode)
        if reason:
            results[subject.ref, mode.name] = ModeResult(subject.name, mode.name, mode.describe(), "skipped", reason,
                                                          dtype=dtype)
        else:
            runs.setdefault(mode.world, []).append((subject, mode))
    for world, world_pairs in sorted(runs.items()):
        _run_world(world, world_pairs, dtype, timeout, results)
    if recheck:
        recheck_float64([pair for world_pairs in runs.values() for pair in world_pairs], results, timeout)
    return [results[subject.ref, mode.name] for subject, mode in wanted]


@pytest.fixture(scope="session")
def plait_conformance() -> Callable[..., dict[tuple[str, str], ModeResult]]:
    """``plait_conformance(*adapters, modes=None, dtype="float32", pairs=())`` -> {(adapter name, mode name):
    ModeResult}: every mode of ``modes`` (default: all) for every adapter of ``adapters``, and the (adapter, mode
    name) ``pairs``, all in the same launches; run once per distinct argument list in the session. An fp32 miss
    shaped like reordering noise comes back as its float64 recheck (``plait.testing.noise``), which decides. Each
    adapter's tiny model is loaded once in the session."""
    cache: dict[tuple, dict[tuple[str, str], ModeResult]] = {}
    subjects: dict[str, Subject] = {}

    def run(*adapters: str | ModuleType, modes: Sequence[str] | None = None, dtype: str = "float32",
            pairs: Sequence[tuple[str | ModuleType, str]] = ()) -> dict[tuple[str, str], ModeResult]:
        refs = tuple(adapter_ref(a) for a in adapters)
        extra = tuple((adapter_ref(a), m) for a, m in pairs)
        key = (refs, tuple(modes or ()), dtype, extra)
        if key not in cache:
            every = [(ref, mode.name) for ref in refs for mode in select_modes(modes)]
            found = run_conformance_pairs([*every, *extra], dtype=dtype, subjects=subjects)
            cache[key] = {(r.adapter, r.mode): r for r in found}
        return cache[key]

    return run
