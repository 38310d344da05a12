"""Which transformers architectures plait trains, proven: the conformance kit over every decoder-only causal LM
of the installed transformers (with or without a declared tp plan), in a reduced matrix, written to
docs/architectures.md.

    python scripts/architecture_sweep.py [--out docs/architectures.md] [--only qwen3 gemma2 ...] [--fresh]

Each architecture gets the tiny config of the adapter serving it (an explicit adapter where one claims it,
else plait-transformers' derived one) and seven modes: ZeRO-1 over 2 data-parallel ranks (what every causal LM
takes, no plan needed), ZeRO-3 over 2 ranks (FSDP2: parameters, gradients and optimizer state sharded,
parameters gathered per decoder layer; 4 steps, gradients clipped to norm 0.5), tp=2 with sequence parallelism,
pp=2 (1F1B), the tp=2 save -> consolidate -> from_pretrained round trip, context parallelism over 2 ranks (cp=2, the
attention strategy ``auto`` picks) and, for models with routed experts, expert parallelism over 2 ranks (ep=2;
"n/a" for a dense model), each 3 AdamW steps (ZeRO-3: 4) against one process. A mode the
layout plan refuses (``plan_layout`` on the meta model, before any process) is "refused" with plait's reason;
what runs is "pass" or "FAIL" with the measured errors. A tp mode that passes while its layout plan keeps blocks
whole on every tp rank (``WholeSequence``: the block runs on the whole sequence, its work repeated on every rank) is
"whole (those modules; ...)" rather than "pass": it matches one process but does not split them, and the summary
counts only "split" cells toward tensor parallelism. Architectures are run a chunk per world; a world
that crashes is rerun one architecture at a time, so a crash is pinned on its architecture.

The whole sweep is CPU-heavy; ``--only`` runs some architectures, ``--modes`` some modes (the others keep
their earlier results). Results accumulate in ``--state`` (a JSON file, one entry per architecture; ``--fresh``
starts it over) and the table is written from it after every run,
with the architectures not run yet marked so. Where the state file is missing (it is not committed), it is
seeded from the table at ``--out``, so a partial run keeps the other rows and cells as they were measured.

``--relabel`` trains nothing: it derives the tp layout plans of every architecture (or ``--only`` some) on meta
models, about 3 minutes for all of them, and relabels the tp cells that passed, "pass" or "whole (...)", by what the
plans keep whole now; cells the plans no longer agree with (a refusal, or other modules kept whole) are named on
stderr, to be rerun with ``--only``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("zero1-dp2", "zero3-dp2", "tp2-sp", "pp2-1f1b", "consolidate-tp2-sp", "cp2", "ep2")
DENSE = "n/a (no routed experts)"  # the ep2 cell of a dense model: nothing to divide, not a refusal
CHUNK = 12  # architectures per world: bounds what one crash costs
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One architecture's line of the table."""

    architecture: str
    adapter: str = "-"
    ref: str | None = None  # what the conformance kit loads (adapter name, or transformers:ARCH)
    cells: dict[str, str] = field(default_factory=dict)  # mode -> result text
    passed: dict[str, bool] = field(default_factory=dict)
    whole: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tp mode -> modules its plan keeps whole


def tp_modes() -> tuple[str, ...]:
    """The modes whose layout splits over tp ranks (tp > 1): those a plan may split or keep blocks whole in."""
    from plait.testing.conformance_modes import MODES as KIT_MODES

    return tuple(m for m in MODES if KIT_MODES[m].layout.get("tp", 1) > 1)


def kept_whole(plan) -> tuple[str, ...]:
    """The modules a layout plan keeps whole on every tp rank, as patterns (layer indices as ``*``): those of a
    ``WholeSequence`` rule, which run on the whole sequence with their work repeated on every rank (a recurrent
    mixer, an attention or MLP no rule splits; docs/decisions.md D10). Read off the plan's shard decisions, so the
    table says whatever the adapter derives or declares."""
    from plait.tp.styles import WholeSequence

    names = {name for shards in plan.shards_by_rank for name, shard in shards.items()
             if isinstance(shard.style, WholeSequence)}
    return tuple(sorted({re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names}))


def label(cell: str, whole: tuple[str, ...]) -> str:
    """A tp cell that matched one process, "pass (X)" or "whole (M; X)", labelled by ``whole`` (the modules its
    plan keeps whole): "whole (M; X)" where it keeps some, else "pass (X)". Any other cell as it is."""
    if cell.startswith("whole ("):
        inner = cell.removeprefix("whole (").partition("; ")[2]
    elif cell.startswith("pass ("):
        inner = cell.removeprefix("pass (")
    else:
        return cell
    return f"whole ({', '.join(whole)}; {inner}" if whole else f"pass ({inner}"


def architectures() -> list[str]:
    """Decoder-only causal-LM model types: what AutoModelForCausalLM builds, less the encoder-decoder and
    encoder-only types (``plait.base.meta.causal_lm_refusal``, the trainer's own check)."""
    from types import SimpleNamespace

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from plait.base.meta import causal_lm_refusal

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if not causal_lm_refusal(SimpleNamespace(model_type=t)))


def declares_tp_plan(arch: str) -> bool:
    """Whether transformers declares a tp plan for ``arch`` (its config class's ``base_model_tp_plan``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[arch], "base_model_tp_plan", None))


def one_line(error: BaseException) -> str:
    """The error in one line: plait's own refusals as they are, anything else prefixed with its type."""
    from plait.base.config import ConfigError
    from plait.plugin.registry import AdapterError

    text = " ".join(str(error).split()).removeprefix("the generic transformers adapter cannot derive this plan: ")
    return text if isinstance(error, (ConfigError, AdapterError)) else f"{type(error).__name__}: {text}"


def prepare(arch: str, modes: tuple[str, ...] = MODES) -> Row:
    """The serving adapter, its tiny config, and each of ``modes`` refused by the layout plan or left to run."""
    from types import SimpleNamespace

    from plait.base.config import ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.ep.layout import other_experts, own_experts, routed_experts
    from plait.layout_plan import plan_layout
    from plait.plugin.registry import default_registry
    from plait.testing.conformance_modes import MODES as KIT_MODES
    from plait.testing.conformance_modes import load_subject

    row = Row(arch)
    adapter, why = default_registry().explain(SimpleNamespace(model_type=arch))
    if adapter is None:
        row.cells = {mode: f"refused: {why}" for mode in modes}
        return row
    row.adapter = adapter.name
    ref = f"{adapter.name}:{arch}" if adapter.info.generic else adapter.name
    try:
        subject = load_subject(ref)
        model = build_meta_model(subject.config)
    except Exception as err:  # a config class whose defaults transformers itself cannot build, shrunk or not
        row.cells = {mode: f"refused: {one_line(err)}" for mode in modes}
        return row
    for mode in modes:
        if mode == "ep2" and not routed_experts(model) and not own_experts(model) and other_experts(model) is None:
            row.cells[mode] = DENSE
            continue
        layout = KIT_MODES[mode]
        try:
            plan = plan_layout(model, ParallelConfig(**layout.layout), layout.world, subject.registry)
        except Exception as err:
            row.cells[mode] = f"refused: {one_line(err)}"
            continue
        if mode in tp_modes():
            row.whole[mode] = kept_whole(plan)
    row.ref = ref
    return row


def chunks(rows: list[Row], modes_of) -> Iterator[tuple[tuple[str, ...], list[Row]]]:
    """(modes, architectures) to run in one world each: rows grouped by the modes ``modes_of(row)`` leaves them
    to run (none: skipped), at most CHUNK architectures per world."""
    groups: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    for row in rows:
        modes = modes_of(row)
        if modes:
            groups[modes].append(row)
    for modes, members in groups.items():
        for start in range(0, len(members), CHUNK):
            yield modes, members[start:start + CHUNK]


def run(rows: list[Row], wanted: tuple[str, ...] = MODES) -> None:
    """Run every one of the ``wanted`` modes not refused, grouped by mode set, a chunk of architectures per world."""
    from plait.testing.conformance import run_conformance

    for modes, chunk in chunks(rows, lambda row: tuple(m for m in wanted if m not in row.cells) if row.ref else ()):
        results = run_conformance([r.ref for r in chunk], list(modes))
        crashed = any("the world crashed" in r.note for r in results)
        if crashed and len(chunk) > 1:
            for row in chunk:  # pin the crash on its architecture
                record(row, run_conformance([row.ref], list(modes)))
        else:
            for row in chunk:  # the kit names a result by its subject: the ref, for both kinds of adapter
                record(row, [r for r in results if r.adapter == row.ref])


def record(row: Row, results) -> None:
    """Each kit result as its cell; an fp32 miss shaped like reordering noise comes back from the kit as its float64
    recheck (``plait.testing.noise``), which decides, and its cell gives both numbers."""
    from plait.testing.noise import noise_note

    for result in results:
        numbers = f"loss {result.loss_rel:.0e}, grad {result.grad_tol:.2f}" if result.loss_rel is not None else ""
        note = " ".join(result.note.split())
        if result.fp32 is not None:
            was = result.fp32
            fp32 = f"fp32: loss {was.loss_rel:.0e}, grad {was.grad_tol:.2f}; {noise_note(was.note)}"
            row.cells[result.mode] = (
                f"pass (float64: loss {result.loss_rel:.0e}, grad {result.grad_tol:.0e}; {fp32})"
                if result.status == "pass" else f"FAIL (float64: {note.split(' (float64 recheck')[0][:200]}; {fp32})")
        elif result.status == "pass":
            row.cells[result.mode] = f"pass ({numbers})"
        elif result.status == "skipped":
            row.cells[result.mode] = f"refused: {note}"
        else:
            row.cells[result.mode] = f"FAIL ({numbers}{'; ' if numbers else ''}{note[:300]})"
        row.cells[result.mode] = label(row.cells[result.mode], row.whole.get(result.mode, ()))
        row.passed[result.mode] = result.status == "pass"


def column_counts(rows: list[Row], mode: str) -> str:
    """'N pass, M refused, K fail' for one mode's column (and 'L n/a' where a mode does not apply); in a tp mode the
    cells that passed are 'S split, W whole': whether the plan split every block or kept some whole."""
    cells = [r.cells.get(mode, "") for r in rows]
    passed = sum(1 for r in rows if r.passed.get(mode))
    whole = sum(1 for r in rows if r.passed.get(mode) and r.cells.get(mode, "").startswith("whole"))
    refused = sum(1 for c in cells if c.startswith("refused"))
    na = sum(1 for c in cells if c == DENSE)
    ran = f"{passed - whole} split, {whole} whole" if mode in tp_modes() else f"{passed} pass"
    return (f"{ran}, {refused} refused, {len(rows) - passed - refused - na} fail or not run"
            + (f", {na} n/a" if na else ""))


def splits_every_block(row: Row) -> bool:
    """Every tp mode passed with nothing kept whole."""
    return all(row.cells.get(m, "").startswith("pass") for m in tp_modes())


def passes_all(row: Row) -> bool:
    """Every mode that applies to the architecture passed."""
    applies = [m for m in MODES if row.cells.get(m) != DENSE]
    return all(row.passed.get(m) for m in applies)


def render(rows: list[Row], seconds: float) -> str:
    import torch
    import transformers

    passing = [r for r in rows if passes_all(r)]
    split = [r for r in passing if splits_every_block(r)]
    via_float64 = [r for r in passing if any("float64" in c for c in r.cells.values())]
    failing = [r for r in rows if any(c.startswith("FAIL") for c in r.cells.values())]
    not_run = [r for r in rows if not r.cells]
    lines = [
        "# Architectures plait trains",
        "",
        f"Written by `scripts/architecture_sweep.py` (transformers {transformers.__version__}, torch "
        f"{torch.__version__}, gloo on CPU, {seconds / 60:.0f} min). Every decoder-only causal LM of the installed "
        f"transformers, with the tiny config of the adapter serving it (`transformers` is the generic "
        f"plait-transformers; `tp plan` says whether transformers declares one it derives plait's from: without one "
        f"it serves every layout but tp > 1), under the conformance kit's modes: "
        + ", ".join(f"`{m}`" for m in MODES) + ". Each mode trains 3 AdamW steps (fp32; `zero3-dp2` 4, "
        "gradients clipped to norm 0.5) against one process; pass: every step's loss within 1e-5 relative and "
        "every gradient within the kit's tolerance (`grad` is the worst |Δ| / (1e-6 + 1e-5·|ref|), at most 1). "
        "`refused` is plait's own refusal, made before any process starts, with its reason; `ep2` is n/a for a "
        "model without routed experts.",
        "",
        f"**{len(passing)} of {len(rows)} pass every mode ({len(via_float64)} of them through the float64 recheck "
        f"below; {len(split)} of them split every block over tp, {len(passing) - len(split)} keep some whole in the tp "
        f"modes); {len(failing)} fail a mode; "
        f"{len(rows) - len(passing) - len(failing) - len(not_run)} are refused in at least one"
        + (f"; {len(not_run)} not run yet" if not_run else "") + ".**",
        "",
        "Per mode: " + "; ".join(f"`{m}` {column_counts(rows, m)}" for m in MODES) + ".",
        "",
        "In the tp modes (" + ", ".join(f"`{m}`" for m in tp_modes()) + ") a cell that matched one process is "
        "`pass` only where the layout plan split every block over the tp ranks, and `whole (M; ...)` where it kept "
        "the modules M whole on every rank instead (a `WholeSequence` rule: under SP the block is handed the whole "
        "sequence and its work is repeated on every rank; docs/decisions.md D10): exact, but M is not "
        "tensor-parallel, so only `split` cells count toward tp in the lines above. M is read off each "
        "architecture's layout plan, not a list: `python scripts/architecture_sweep.py --relabel` re-derives it for "
        "every architecture from meta models, without training.",
        "",
        "`pass (float64: ...; fp32: ...)`: in fp32 every loss was within 1e-5 and every step-1 gradient within "
        "tolerance, but a later step's gradient was over it: Adam (eps 1e-6) amplifies fp32 "
        "reordering noise in some tiny models (tests/test_generic_conformance.py measures it for gemma3_text, "
        "mixtral and olmo2); or a step-1 gradient was at most 10x the tolerance (Gemma 4: one process in fp32 is "
        "2.6x the tolerance off its own float64 gradient). The same mode then ran in float64, where that noise "
        "shrinks 20-300x while a mis-split module stays off by 1e-4 or more, and passed there. The float64 run is "
        "float64 throughout: transformers computes RMSNorm, softmax and Mamba2's scan in fp32 even in a float64 "
        "model (`hidden_states.to(torch.float32)`, `.float()`), and the kit's worker makes every float32 a torch "
        "function is asked for float64, on the reference and on plait's side alike "
        "(`plait.testing.conformance_worker.Float64Throughout`). Without it that fp32 rounding stayed in the float64 "
        "run and any reordering showed it: flex_olmo's split q/k norms (`SplitRMSNorm`) missed by 1.3x the tolerance "
        "at step 3, mamba2 by up to 34x at steps 2-3 (its float64 gradients over 4 microbatches differ from one "
        "batch's by 5e-8 of the largest entry on one process, without plait; 6e-16 float64 throughout). Every "
        "float64 cell of this table was decided under this rule.",
        "",
        "| architecture | adapter | tp plan | " + " | ".join(MODES) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in MODES) + " |",
    ]
    for row in rows:
        cells = [row.cells.get(m, "not run" if not row.cells else "-").replace("|", "\\|") for m in MODES]
        plan = "declared" if declares_tp_plan(row.architecture) else "none"
        lines.append(f"| {row.architecture} | {row.adapter} | {plan} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    parser.add_argument("--state", type=Path, default=ROOT / "build" / "architecture_sweep.json")
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these architectures only")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="run these modes only (the others keep their earlier results)")
    parser.add_argument("--fresh", action="store_true", help="forget the results of earlier runs")
    parser.add_argument("--relabel", action="store_true",
                        help="train nothing: relabel the tp cells that passed as split or whole by the layout plans "
                             "derived now on meta models, and refresh the tp refusals")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    state = {} if args.fresh else json.loads(args.state.read_text()) if args.state.exists() else \
        seed_from_table(args.out)
    start = time.monotonic()
    everything = architectures()
    unknown = sorted(set(args.only or ()) - set(everything))
    if unknown:
        parser.error(f"{unknown} are not decoder-only causal LMs; choose from {everything}")
    if args.relabel:
        stale = relabel(state, args.only or everything)
        print(f"relabelled from the plans in {time.monotonic() - start:.0f} s"
              + (f"; the plans no longer agree with these cells, rerun them: {stale}" if stale else ""),
              file=sys.stderr)
        write(args.state, json.dumps(state, indent=1))
        table = [Row(a, **{k: v for k, v in state[a].items()}) if a in state else Row(a) for a in everything]
        write(args.out, render(table, state.get("_seconds", 0.0)))
        return 0
    rows = []
    modes = tuple(args.modes)
    for arch in args.only or everything:
        rows.append(prepare(arch, modes))
        print(f"{arch}: {rows[-1].adapter}, to run: {[m for m in modes if m not in rows[-1].cells]}", file=sys.stderr)
    print(f"{len(rows)} architectures; {sum(1 for r in rows if r.ref)} with modes to run", file=sys.stderr)
    run(rows, modes)
    seconds = time.monotonic() - start + state.pop("_seconds", 0.0)
    for r in rows:  # the modes run replace their cells; the others keep theirs
        old = state.get(r.architecture, {"cells": {}, "passed": {}})
        state[r.architecture] = {"adapter": r.adapter, "cells": {**old["cells"], **r.cells},
                                 "passed": {**{m: v for m, v in old["passed"].items() if m not in modes}, **r.passed}}
    state["_seconds"] = seconds
    write(args.state, json.dumps(state, indent=1))
    table = [Row(a, **{k: v for k, v in state[a].items()}) if a in state else Row(a) for a in everything]
    write(args.out, render(table, seconds))
    print(f"wrote {args.out} and {args.state}", file=sys.stderr)
    return 0


def relabel(state: dict, archs: list[str]) -> list[str]:
    """Relabel ``state``'s tp cells of ``archs`` from their layout plans alone (meta models, no process): a cell that
    passed becomes "pass" or "whole (...)" by what the plan keeps whole now (``label``); a refusal takes the plan's
    current text. The numbers stay those measured, so this holds only for cells measured with the plans derived
    now: returns "ARCH MODE (was -> now)" for the cells the plans no longer agree with, to rerun with ``--only``:
    refused now but run before (made refused), run now but refused before, or "whole (M; ...)" where the plan keeps
    other modules whole now (both left as they are). A "pass" cell keeps no record of its plan: one measured before
    this labelling (or with a plan since changed from split to whole) is relabelled as the plan is now."""
    stale = []
    for arch in archs:
        entry = state.get(arch)
        if entry is None:
            continue
        row = prepare(arch, tp_modes())
        for mode in tp_modes():
            cell, now = entry["cells"].get(mode), row.cells.get(mode, "")
            if cell is None:
                continue
            if now.startswith("refused"):
                if not cell.startswith("refused"):
                    stale.append(f"{arch} {mode} ({cell.split(' ')[0]} -> refused)")
                entry["cells"][mode], entry["passed"][mode] = now, False
            elif cell.startswith("refused"):
                stale.append(f"{arch} {mode} (refused -> runs)")
            elif entry["passed"].get(mode):
                whole = row.whole.get(mode, ())
                if cell.startswith("whole (") and recorded_whole(cell) != whole:  # measured with other plans
                    stale.append(f"{arch} {mode} (whole {', '.join(recorded_whole(cell))} -> "
                                 f"{', '.join(whole) or 'split'})")
                else:
                    entry["cells"][mode] = label(cell, whole)
    return stale


def recorded_whole(cell: str) -> tuple[str, ...]:
    """The modules a "whole (M; ...)" cell records as kept whole."""
    return tuple(cell.removeprefix("whole (").partition("; ")[0].split(", "))


def seed_from_table(path: Path) -> dict:
    """The state a table written by ``render`` records: each architecture's adapter, cells and passes, and the
    minutes the run took. Cells of modes the table has no column for are left out (not run)."""
    if not path.exists():
        return {}
    state: dict = {}
    columns: list[str] = []
    for line in text_table(path.read_text()).splitlines():
        if line.startswith("Written by") and " min)" in line:
            state["_seconds"] = 60.0 * float(line.split(" min)")[0].rpartition(" ")[2])
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        cells = [c.strip("| ").replace("\x00", "|") for c in line.replace("\\|", "\x00").split(" | ")]
        if cells[0] == "architecture":
            columns = cells[3:]
            continue
        found = {m: c for m, c in zip(columns, cells[3:]) if c not in ("not run", "-")}
        state[cells[0]] = {"adapter": cells[1], "cells": found,
                           "passed": {m: c.startswith(("pass", "whole")) for m, c in found.items() if c != DENSE}}
    return state


IMAGE_TEXT = "<!-- image-text sweep: begin -->"  # scripts/vision_sweep.py's section, after this sweep's table


def text_table(text: str) -> str:
    """The part of docs/architectures.md this sweep writes: everything before the image-text section."""
    return text.partition(IMAGE_TEXT)[0]


def write(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so an interrupted run leaves the old file whole; the
    image-text section scripts/vision_sweep.py wrote after the table is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = path.read_text().partition(IMAGE_TEXT) if path.exists() else ("", "", "")
    if kept[1]:
        text = text.rstrip("\n") + "\n\n" + kept[1] + kept[2]
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text)
    temp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
