"""The adapter conformance kit: does an adapter give one-process numbers under every parallel mode?

For each adapter, the kit builds the model of its ``plait_tiny_config`` and, for every mode of ``MODES``,
trains it for 3 AdamW steps (lr 1e-3, fp32) twice on every rank: as plain transformers + torch (the
reference) and through ``plait.parallelize`` in the mode's layout. A mode passes when every step's loss is
within 1e-5 relative and every gradient within ``assert_close(rtol=1e-5, atol=1e-6)`` of the reference's.

Adam's eps is 1e-6, not torch's 1e-8: the update g / (sqrt(v) + eps) changes by up to lr / eps per unit
of gradient near g = 0, so with 1e-8 the fp32 rounding difference of two summation orders (1e-10 on a
near-zero gradient) moves a parameter by ~1e-5, and the next step's gradients by ~1e-6 (measured: Mistral
at tp=4, step-2 gradients at 1.07x the tolerance with eps 1e-8, 0.03x with 1e-6; step 1 at 0.02x either
way). lr 1e-2 amplifies the same noise tenfold. A mis-sharded layer is off by 1e-4 or more at step 1.
Parameters are not compared: every later loss and gradient depends on them.

``dtype="float64"`` runs the same check in double precision. Some tiny models amplify fp32 reordering noise
past the tolerance by step 2 or 3 even with eps 1e-6 (Adam divides by sqrt(v)). In float64 the matmuls and
tp reductions reorder at 1e-16, and so does what transformers computes in fp32 even in a float64 model (softmax,
RMSNorm, Mamba2's scan): the worker runs float64 throughout, every float32 asked for made float64
(``conformance_worker.Float64Throughout``), so that noise drops 20-300x (measured at tp=2 with SP: gemma3_text 2.5x the tolerance in fp32, 0.04x in float64; mixtral
1.9x, 0.008x; olmo2 0.12x in float64), while a mis-split layer stays off by 1e-4: a float64 pass tells the
two apart. MoE experts run transformers' eager kernel there (torch's grouped matmul takes no float64).

Modes are data (``conformance_modes.MODES``): a new parallel mode is one ``Mode``. Modes the adapter or its tiny config cannot run (a capability it does not declare, no kv heads fewer than
tp) are skipped with the reason. One launch per world size runs every (adapter, mode) pair of that size.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from plait.base.config import ConfigError, ParallelConfig
from plait.layout_plan import check_capabilities
from plait.plugin.registry import AdapterError
from plait.testing.conformance_modes import (
    ADAM_EPS, ATOL, LOSS_RTOL, LR, MODES, RTOL, STEPS, Mode, Subject, adapter_ref, load_subject, with_overrides,
)
from plait.testing.launcher import WorkerFailure, launch
from plait.testing.noise import fp32_noise, noise_note

WORKER = "plait.testing.conformance_worker"
DTYPES = ("float32", "float64")
# The watchdog's allowance per (adapter, mode) pair of a world, on top of 4 minutes of start-up: a pair of the
# tiny models takes about 0.7 s on 2 CPU cores (the generic kit: ~200 pairs in 130-150 s), so 5 s leaves a busy
# machine room while a hang of the whole generic kit is reported after ~20 minutes rather than ~100.
PAIR_SECONDS = 5


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class ModeResult:
    """One (adapter, mode) outcome. ``status``: "pass", "FAIL" or "skipped"; errors are the worst over steps
    and ranks (``grad_tol``: worst |Δ| / (atol + rtol |reference|), at most 1 to pass)."""

    adapter: str
    mode: str
    layout: str
    status: str
    note: str = ""
    loss_rel: float | None = None
    grad_err: float | None = None
    grad_tol: float | None = None
    dtype: str = "float32"
    fp32: ModeResult | None = None  # a float64 recheck's result: the fp32 miss it decided (plait.testing.noise)

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def _skip_reason(subject: Subject, mode: Mode) -> str | None:
    """Why ``mode`` does not run for ``subject`` (None: it runs): a capability the adapter does not declare, a
    plan the layout needs that its hook refuses (the generic adapter for a model transformers gives no tp plan),
    or what the mode's own check finds."""
    layout = ParallelConfig(**mode.layout)
    config = with_overrides(subject.config, mode.model)
    try:
        check_capabilities(subject.adapter, layout, config)
        if layout.tp > 1:
            subject.registry.tp_plan(subject.adapter, config)
        if layout.sequence_parallel:
            subject.registry.sp_plan(subject.adapter, config)
        if layout.pp > 1:
            subject.registry.pipeline_plan(subject.adapter, config)
    except ConfigError as err:
        return str(err)
    return mode.applies(subject) if mode.applies else None


def select_modes(names: Sequence[str] | None) -> list[Mode]:
    if not names:
        return list(MODES.values())
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ConfigError(f"unknown conformance mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return [MODES[n] for n in names]


def _merge(subject: Subject, mode: Mode, per_rank: dict[int, dict], dtype: str, missing: list[str]) -> ModeResult:
    """One mode's result from the records of the ranks that finished it (worst numbers, the first distinct
    failures), plus ``missing``: why the other ranks did not finish it."""
    result = ModeResult(subject.name, mode.name, mode.describe(), "pass", dtype=dtype)
    failures: list[str] = []
    # A rank's error is prefixed by its rank unless every rank raised the same (numeric mismatches are per shard
    # and read alike without it). The cause first: a rank whose collective failed because its partner had left
    # only echoes the partner's error.
    raised = {record["failures"][-1] for record in per_rank.values() if record["crashed"]}
    alike = not missing and (not raised or (len(raised) == 1 and all(r["crashed"] for r in per_rank.values())))
    for rank, record in sorted(per_rank.items(), key=lambda item: (_echoes_a_peer(item[1]), item[0])):
        for failure in record["failures"]:
            text = failure if alike or not record["crashed"] else f"rank {rank}: {failure}"
            if text not in failures:
                failures.append(text)
    for key in ("loss_rel", "grad_err", "grad_tol"):
        values = [r[key] for r in per_rank.values() if r.get(key) is not None]
        setattr(result, key, max(values) if values else None)
    if per_rank and not missing and not any(r["crashed"] for r in per_rank.values()):
        checked = set().union(*(r["checked"] for r in per_rank.values()))
        unchecked = sorted(set(next(iter(per_rank.values()))["expected"]) - checked)
        if unchecked:
            failures.append(f"parameters no rank compared: {', '.join(unchecked[:4])}")
    failures += missing
    if failures:
        result.status, result.note = "FAIL", "; ".join(failures[:4])
    return result


def _echoes_a_peer(record: dict) -> bool:
    return any("closed by peer" in f or "Connection reset" in f for f in record["failures"])


def _read_world(out: Path, world: int) -> tuple[dict[str, dict[int, dict]], set[str], dict[int, str]]:
    """What one world left on disk: each pair's records by rank, the pairs some rank started, and where each
    rank's Python stack was when a failed rank asked for it (empty if it was not asked)."""
    records: dict[str, dict[int, dict]] = {}
    started: set[str] = set()
    stacks: dict[int, str] = {}
    for rank in range(world):
        log = out / f"rank{rank}.jsonl"
        for line in log.read_text().splitlines() if log.exists() else ():
            if not line.endswith("}"):
                continue  # a line the rank was writing when it ended
            entry = json.loads(line)
            started.add(entry["key"])
            if entry["event"] == "done":
                records.setdefault(entry["key"], {})[rank] = entry["record"]
        stack = out / f"rank{rank}.stack"
        if stack.exists() and stack.read_text().strip():
            stacks[rank] = _short_stack(stack.read_text())
    return records, started, stacks


def _short_stack(dump: str, frames: int = 4) -> str:
    """faulthandler's dump (innermost call first) as ``comm.py:111 all_gather <- layers.py:41 __call__ ...``."""
    found = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', dump)
    return " <- ".join(f"{Path(f).name}:{line} {fn}" for f, line, fn in found[:frames])


def _run_world(world: int, pairs: list[tuple[Subject, Mode]], dtype: str, timeout: float | None,
               results: dict[tuple[str, str], ModeResult]) -> None:
    """Run ``pairs`` in worlds of ``world`` ranks: one world for all of them while every pair ends on every
    rank, a fresh world for the pairs after one that did not (a rank raised while another waited for it in a
    collective, a rank died, a hang), whose result then says what each rank was doing."""
    pending = list(pairs)
    while pending:
        out = Path(tempfile.mkdtemp(prefix=f"plait-conformance-w{world}-"))
        spec = {"out": str(out), "dtype": dtype, "runs": [[s.ref, m.name] for s, m in pending]}
        (out / "spec.json").write_text(json.dumps(spec))
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the worker imports what we import
        crash = None
        try:
            launch(["-m", WORKER, str(out / "spec.json")], world, env=env,
                   timeout=timeout or 240 + PAIR_SECONDS * len(pending) * math.ceil(world / 2))
        except WorkerFailure as err:
            crash = " ".join(str(err).split())
        records, started, stacks = _read_world(out, world)
        shutil.rmtree(out, ignore_errors=True)
        if crash and not started:  # the world failed before any pair (start-up): a fresh one would too
            for subject, mode in pending:
                results[subject.ref, mode.name] = _merge(subject, mode, {}, dtype, [
                    f"the world ended before any mode started: {crash[-1500:]}"])
            return
        finished = 0
        for subject, mode in pending:
            key = f"{subject.ref}|{mode.name}"
            per_rank = records.get(key, {})
            if len(per_rank) < world and key not in started:
                break  # the next world runs it
            missing = [] if len(per_rank) == world else _missing(world, per_rank, stacks, crash)
            results[subject.ref, mode.name] = _merge(subject, mode, per_rank, dtype, missing)
            finished += 1
        pending = pending[finished:]


def _missing(world: int, per_rank: dict[int, dict], stacks: dict[int, str], crash: str | None) -> list[str]:
    """Why the ranks without a record of a pair they started have none."""
    why = []
    for rank in (r for r in range(world) if r not in per_rank):
        if rank in stacks:
            why.append(f"rank {rank} did not finish: still inside the mode after another rank had failed, at "
                       f"{stacks[rank]}")
        else:
            why.append(f"rank {rank} did not finish")
    if crash and len(stacks) < world - len(per_rank):
        why.append(f"the world ended: {crash[-1500:]}")
    return why


def run_conformance(
    adapters: Sequence[str | ModuleType], modes: Sequence[str] | None = None, *, timeout: float | None = None,
    dtype: str = "float32", recheck: bool = True,
) -> list[ModeResult]:
    """Run the modes (default: all) for every adapter; one launch per world size covers all of them, and a
    fresh launch the pairs after a pair that left its world broken. ``recheck``: an fp32 miss shaped like
    reordering noise is decided in float64 (``recheck_float64``).

    Raises AdapterError (unknown adapter, no ``plait_tiny_config``) or ConfigError (unknown mode or dtype)
    before launching anything.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"conformance dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    subjects = [load_subject(adapter_ref(a)) for a in adapters]
    selected = select_modes(modes)
    results: dict[tuple[str, str], ModeResult] = {}
    runs: dict[int, list[tuple[Subject, Mode]]] = {}
    for subject in subjects:
        for mode in selected:
            reason = _skip_reason(subject, mode)
            if reason:
                results[subject.ref, mode.name] = ModeResult(subject.name, mode.name, mode.describe(), "skipped", reason,
                                                              dtype=dtype)
            else:
                runs.setdefault(mode.world, []).append((subject, mode))
    for world, pairs in sorted(runs.items()):
        _run_world(world, pairs, dtype, timeout, results)
    if recheck:
        recheck_float64([pair for pairs in runs.values() for pair in pairs], results, timeout)
    return [results[s.ref, r.name] for s in subjects for r in selected]


def recheck_float64(pairs: Sequence[tuple[Subject, Mode]], results: dict[tuple[str, str], ModeResult],
                    timeout: float | None = None) -> None:
    """Run the ``pairs`` whose fp32 result is shaped like reordering noise (``plait.testing.noise``) again in
    float64, one launch per world size, and put the float64 result, which decides, in their place (its ``fp32``
    keeps the miss it decided)."""
    noisy = [(s, m) for s, m in pairs if fp32_noise(results[s.ref, m.name])]
    found: dict[tuple[str, str], ModeResult] = {}
    for world in sorted({m.world for _, m in noisy}):
        _run_world(world, [(s, m) for s, m in noisy if m.world == world], "float64", timeout, found)
    for key, result in found.items():
        fp32 = results[key]
        result.fp32 = fp32
        result.note = " ".join(filter(None, [result.note, f"(float64 recheck of fp32: loss {fp32.loss_rel:.0e}, "
                                                          f"grad {fp32.grad_tol:.2f}; {noise_note(fp32.note)})"]))
        results[key] = result


# --------------------------------------------------------------------------------------------------
# Output and the `plait check-adapter` command
# --------------------------------------------------------------------------------------------------


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def render_table(results: Sequence[ModeResult], console: Any = None) -> None:
    """Print the pass/fail table (rich) with the measured errors."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    dtypes = "/".join(sorted({r.dtype for r in results})) or "float32"
    table = Table(title=f"plait conformance: {STEPS} AdamW steps (lr {LR:g}, eps {ADAM_EPS:g}, {dtypes}) against one "
                        f"process; pass: loss rel <= {LOSS_RTOL:g}, grad |Δ| <= {ATOL:g} + {RTOL:g}·|ref| (tol <= 1)")
    for column in ("adapter", "mode", "layout", "result", "loss rel", "grad |Δ|", "grad tol", "note"):
        table.add_column(column, overflow="fold")
    style = {"pass": "green", "FAIL": "bold red", "skipped": "dim"}
    for r in results:
        table.add_row(r.adapter, r.mode, r.layout, f"[{style[r.status]}]{r.status}[/]", _num(r.loss_rel),
                      _num(r.grad_err), _num(r.grad_tol), escape(r.note))  # notes quote errors: "[...]" is text
    (console or Console(width=max(Console().width, 160))).print(table)


def summary(results: Sequence[ModeResult]) -> str:
    """How much was proven, per adapter: modes run, passed, failed, and the skipped ones grouped by reason."""
    lines = []
    for adapter in dict.fromkeys(r.adapter for r in results):
        mine = [r for r in results if r.adapter == adapter]
        ran = [r for r in mine if r.status != "skipped"]
        failed = [r.mode for r in ran if r.failed]
        line = (f"{adapter}: {len(ran)} of {len(mine)} modes ran: {len(ran) - len(failed)} passed, {len(failed)} failed"
                + (f" ({', '.join(failed)})" if failed else ""))
        reasons: dict[str, list[str]] = {}
        for r in mine:
            if r.status == "skipped":
                reasons.setdefault(r.note, []).append(r.mode)
        if reasons:
            line += f"; {sum(map(len, reasons.values()))} skipped: " + "; ".join(
                f"{', '.join(names)} ({reason})" for reason, names in reasons.items())
        lines.append(line)
    return "\n".join(lines)


def check_adapter_command(name: str, modes: list[str] | None, dtype: str = "float32") -> int:
    """``plait check-adapter NAME [--modes ...] [--dtype ...]``: print the table and how much it proved; 0 when
    no mode fails, 1 when one does (or could not finish), 2 for an unknown adapter or mode, or an adapter without
    ``plait_tiny_config``."""
    try:
        results = run_conformance([name], modes, dtype=dtype)
    except (AdapterError, ConfigError) as err:
        print(f"plait: error: {err}", file=sys.stderr)
        return 2
    render_table(results)
    print(summary(results))
    return 1 if any(r.failed for r in results) else 0
