"""The adapter conformance kit: does an adapter give one-process numbers under every parallel mode?

For each adapter, the kit builds the model of its ``plait_tiny_config`` and, for every row of ``ROWS``,
trains it for 3 AdamW steps (lr 1e-3, fp32) twice on every rank: as plain transformers + torch (the
reference) and through ``plait.parallelize`` in the row's layout. A row passes when every step's loss is
within 1e-5 relative and every gradient within ``assert_close(rtol=1e-5, atol=1e-6)`` of the reference's.

Adam's eps is 1e-6, not torch's 1e-8: the update g / (sqrt(v) + eps) changes by up to lr / eps per unit
of gradient near g = 0, so with 1e-8 the fp32 rounding difference of two summation orders (1e-10 on a
near-zero gradient) moves a parameter by ~1e-5, and the next step's gradients by ~1e-6 (measured: Mistral
at tp=4, step-2 gradients at 1.07x the tolerance with eps 1e-8, 0.03x with 1e-6; step 1 at 0.02x either
way). lr 1e-2 amplifies the same noise tenfold. A mis-sharded layer is off by 1e-4 or more at step 1.
Parameters are not compared: every later loss and gradient depends on them.

Rows are data: a new parallel mode is one ``Row`` in ``ROWS``, naming the plait feature it needs; while the
feature is absent from the installed plait the row reports "skipped: requires <feature>". Rows the adapter
or its tiny config cannot run (a capability it does not declare, no kv heads fewer than tp) are skipped
with the reason. One launch per world size runs every (adapter, row) pair of that size.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from plait.config import ConfigError, ParallelConfig
from plait.plan import Attention
from plait.registry import Adapter, AdapterError, Registry

STEPS, LR, ADAM_EPS, BATCH, SEQ = 3, 1e-3, 1e-6, 4, 16  # BATCH: sequences per data-parallel rank and step
LOSS_RTOL, RTOL, ATOL = 1e-5, 1e-5, 1e-6
WORKER = "plait.testing.conformance_worker"


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

    from plait.sharding import plan_tensor_parallel

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


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class RowResult:
    """One (adapter, row) outcome. ``status``: "pass", "FAIL" or "skipped"; errors are the worst over steps
    and ranks (``grad_tol``: worst |Δ| / (atol + rtol |reference|), at most 1 to pass)."""

    adapter: str
    row: str
    layout: str
    status: str
    note: str = ""
    loss_rel: float | None = None
    grad_err: float | None = None
    grad_tol: float | None = None

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def _skip_reason(subject: Subject, row: Row) -> str | None:
    from plait.parallelize import _check_capabilities

    missing = [f.name for f in row.requires if not f.present()]
    if missing:
        return f"requires {', '.join(missing)}"
    try:
        _check_capabilities(subject.adapter, ParallelConfig(**row.layout), with_overrides(subject.config, row.model))
    except ConfigError as err:
        return str(err)
    return row.applies(subject) if row.applies else None


def select_rows(names: Sequence[str] | None) -> list[Row]:
    if not names:
        return list(ROWS.values())
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ConfigError(f"unknown conformance row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    return [ROWS[n] for n in names]


def _merge(subject: Subject, row: Row, per_rank: list[dict]) -> RowResult:
    """One row's result from every rank's record: worst numbers, the first distinct failures."""
    result = RowResult(subject.name, row.name, row.describe(), "pass")
    failures: list[str] = []
    for record in per_rank:
        failures += [f for f in record["failures"] if f not in failures]
    for key in ("loss_rel", "grad_err", "grad_tol"):
        values = [r[key] for r in per_rank if r.get(key) is not None]
        setattr(result, key, max(values) if values else None)
    checked = set().union(*(r["checked"] for r in per_rank))
    unchecked = sorted(set(per_rank[0]["expected"]) - checked)
    if unchecked and not any(r["crashed"] for r in per_rank):
        failures.append(f"parameters no rank compared: {', '.join(unchecked[:4])}")
    if failures:
        result.status, result.note = "FAIL", "; ".join(failures[:3])
    return result


def run_conformance(
    adapters: Sequence[str | ModuleType], rows: Sequence[str] | None = None, *, timeout: float | None = None,
) -> list[RowResult]:
    """Run the rows (default: all) for every adapter; one launch per world size covers all of them.

    Raises AdapterError (unknown adapter, no ``plait_tiny_config``) or ConfigError (unknown row) before
    launching anything.
    """
    from plait.testing.launcher import WorkerFailure, launch

    subjects = [load_subject(adapter_ref(a)) for a in adapters]
    selected = select_rows(rows)
    results: dict[tuple[str, str], RowResult] = {}
    runs: dict[int, list[tuple[Subject, Row]]] = {}
    for subject in subjects:
        for row in selected:
            reason = _skip_reason(subject, row)
            if reason:
                results[subject.ref, row.name] = RowResult(subject.name, row.name, row.describe(), "skipped", reason)
            else:
                runs.setdefault(row.world, []).append((subject, row))
    for world, pairs in sorted(runs.items()):
        out = Path(tempfile.mkdtemp(prefix=f"plait-conformance-w{world}-"))
        spec = {"out": str(out), "runs": [[s.ref, r.name] for s, r in pairs]}
        (out / "spec.json").write_text(json.dumps(spec))
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the worker imports what we import
        try:
            launch(["-m", WORKER, str(out / "spec.json")], world, env=env,
                   timeout=timeout or 240 + 30 * len(pairs) * math.ceil(world / 2))
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        except WorkerFailure as err:
            for subject, row in pairs:
                results[subject.ref, row.name] = RowResult(subject.name, row.name, row.describe(), "FAIL",
                                                           f"the world crashed: {str(err)[-1500:]}")
            continue
        finally:
            shutil.rmtree(out, ignore_errors=True)
        for subject, row in pairs:
            key = f"{subject.ref}|{row.name}"
            results[subject.ref, row.name] = _merge(subject, row, [rank[key] for rank in ranks])
    return [results[s.ref, r.name] for s in subjects for r in selected]


# --------------------------------------------------------------------------------------------------
# Output and the `plait check-adapter` command
# --------------------------------------------------------------------------------------------------


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def render_table(results: Sequence[RowResult], console: Any = None) -> None:
    """Print the pass/fail table (rich) with the measured errors."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plait conformance: {STEPS} AdamW steps (lr {LR:g}, eps {ADAM_EPS:g}, fp32) against one process; pass: "
                        f"loss rel <= {LOSS_RTOL:g}, grad |Δ| <= {ATOL:g} + {RTOL:g}·|ref| (tol <= 1)")
    for column in ("adapter", "row", "layout", "result", "loss rel", "grad |Δ|", "grad tol", "note"):
        table.add_column(column, overflow="fold")
    style = {"pass": "green", "FAIL": "bold red", "skipped": "dim"}
    for r in results:
        table.add_row(r.adapter, r.row, r.layout, f"[{style[r.status]}]{r.status}[/]", _num(r.loss_rel),
                      _num(r.grad_err), _num(r.grad_tol), r.note)
    (console or Console(width=max(Console().width, 160))).print(table)


def check_adapter_command(name: str, rows: list[str] | None) -> int:
    """``plait check-adapter NAME [--rows ...]``: print the table; 0 when no row fails, 1 when one does,
    2 for an unknown adapter or row, or an adapter without ``plait_tiny_config``."""
    try:
        results = run_conformance([name], rows)
    except (AdapterError, ConfigError) as err:
        print(f"plait: error: {err}", file=sys.stderr)
        return 2
    render_table(results)
    return 1 if any(r.failed for r in results) else 0
