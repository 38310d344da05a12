"""The architecture sweep's image-text column (issue 49.4): every image-text-to-text model type of the installed
transformers trained by plait at tp=2 with SP, ZeRO-3 over 2 ranks and pp=2 against one process, written as a
section at the end of docs/architectures.md (scripts/architecture_sweep.py rewrites that file without it: rerun this
after it).

    python scripts/vision_sweep.py [--out docs/architectures.md] [--only llava gemma3 ...]

A type whose tiny model (plait_transformers.tiny_vision) does not train on one process is refused in every mode with
``tiny_vision.check``'s reason; a mode plait's layout plan refuses on the meta model is refused before any process
starts. The rest run TYPES_PER_WORLD types to a world of 2 (plait_transformers.vision_sweep_worker): fp32 and a
float64 recheck as tests/workers/vlm_parity.py runs them, judged by tests/test_vlm.py's bounds. A case that raises
is its cell (a ConfigError: refused; else FAIL) and the world goes on; a world that ends early (a crash, a partner
stuck, a hang) is started again on the cases it left, a crash made the FAIL of the case it happened in.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- image-text sweep: begin -->", "<!-- image-text sweep: end -->"
TYPES_PER_WORLD = 6  # a world costs a second or two to start; a crash loses the time of its cases, not their cells
# tests/test_vlm.py's gradient bound; its fp32 loss bound (1e-6) holds for the families it runs, but across all types
# Adam grows fp32 rounding to 3e-6 relative by step 3 (glm4v, step3p7). The float64 run is float64 throughout (the
# kit's Float64Throughout: transformers' fp32 casts, RMSNorm's, softmax's, Gemma 4's vision pooler's, left 3.2e-9 in
# the loss and Gemma 4's vision gradients 5e-7 apart under dp before), and the Gemmas' embedding scale is the float32
# buffer's value on plait's side too (its exact root left 2e-11): every type's float64 loss within 8e-15. A bound
# about three times each, where a wrong plan or a lost input misses by 1e-4 or more (as Cohere Compass's grid
# positions did before pp and cp computed them)
FP32_LOSS, FLOAT64_LOSS, GRAD_UNITS = 1e-5, 3e-14, 1.0


def preflight(model_type: str, modes: tuple[str, ...]) -> dict[str, str]:
    """The modes plait's layout plan refuses for ``model_type``'s tiny model, as "refused: why" cells, planned on the
    meta model before any process starts. Any other error is left to the world, where parallelize raises it too."""
    from plait import AdapterError, ConfigError, ParallelConfig
    from plait.base.meta import build_meta_model
    from plait.layout_plan import plan_layout
    from plait_transformers.vision_parity import sweep_config
    from plait_transformers.vision_sweep_worker import LAYOUTS

    try:
        model = build_meta_model(sweep_config(model_type))
    except Exception:
        return {}
    cells = {}
    for mode in modes:
        try:
            plan_layout(model, ParallelConfig(**LAYOUTS[mode]), 2)
        except (ConfigError, AdapterError) as error:
            cells[mode] = "refused: " + " ".join(str(error).split())[:300]
        except Exception:
            continue
    return cells


def loss_misses(got: dict) -> list[float]:
    """Each step's relative loss error (NaN where a loss is not finite)."""
    return [abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) else math.nan
            for a, b in zip(got["losses"], got["ref_losses"], strict=True)]


def worst(values: list[float]) -> tuple[int, float]:
    """(1-based step, value) of the largest value, a NaN counting as the largest."""
    step = max(range(len(values)), key=lambda i: math.inf if math.isnan(values[i]) else values[i])
    return step + 1, values[step]


def verdict(result: dict) -> str:
    """The cell of one case's fp32 and float64 comparisons: pass when the tests' bounds hold, else FAIL with what
    missed (the worst step and value of each bound missed)."""
    fp32, fp64 = result["fp32"], result["float64"]
    misses = []
    for name, got in (("fp32", fp32), ("float64", fp64)):
        if got["unmatched"]:
            misses.append(f"{name} gradients compared are not the trained ones: {', '.join(got['unmatched'][:4])}")
    checks = (("fp32 loss", loss_misses(fp32), FP32_LOSS), ("float64 loss", loss_misses(fp64), FLOAT64_LOSS),
              ("float64 grad", fp64["grad_error_by_step"], GRAD_UNITS))
    for name, values, bound in checks:
        step, value = worst(values)
        if not value <= bound:
            misses.append(f"{name} {value:.2g} at step {step} (bound {bound:g})")
    numbers = (f"fp32 loss {worst(loss_misses(fp32))[1]:.0e}, grad {worst(fp32['grad_error_by_step'])[1]:.3g}; "
               f"float64 loss {worst(loss_misses(fp64))[1]:.0e}, grad {worst(fp64['grad_error_by_step'])[1]:.2g}")
    return f"FAIL: {'; '.join(misses)} ({numbers})" if misses else f"pass ({numbers})"


def cell(entries: list[dict]) -> str:
    """One case's cell from the ranks' lines: a refusal or error on any rank (rank 0's first; a gloo connection
    error last, the symptom of its partner's crash or of collectives out of step), else a hang, else the verdict
    of the comparison (the same on every rank: ``compare`` is a collective)."""
    for entry in sorted(entries, key=lambda e: "gloo/transport" in e.get("error", "")):
        if "refused" in entry:
            return f"refused: {entry['refused']}"
        if "gloo/transport" in entry.get("error", ""):
            return (f"FAIL: rank {entry['rank']} lost its partner inside a collective (a crash, or collectives out "
                    f"of step): {entry['error'][:160]}")
        if "error" in entry:
            return f"FAIL: {entry['error']}"
    hangs = [e["hang"] for e in entries if "hang" in e]
    return f"FAIL: {hangs[0]}" if hangs else verdict(entries[0]["result"])


def run_world(plan: list[tuple[str, list[str]]], cells: dict[tuple[str, str], str], workdir: Path) -> None:
    """Run ``plan``'s cases in worlds of 2 until each has a cell: a world that dies is started again on the cases
    it left, the one it died in (the dead rank's first without its line) made a FAIL."""
    from plait.testing import WorkerFailure, launch
    from plait_transformers.vision_sweep_worker import CASE_SECONDS, HANG_EXIT

    attempt = 0
    while plan:
        attempt += 1
        prefix = workdir / f"world{attempt}"
        (workdir / f"plan{attempt}.json").write_text(json.dumps(plan))
        cases = sum(len(modes) + 1 for _, modes in plan)  # a model and references per type, then its modes
        died = None
        try:
            launch(["-m", "plait_transformers.vision_sweep_worker", str(workdir / f"plan{attempt}.json"),
                    str(prefix)], 2, timeout=CASE_SECONDS * cases + 60)
        except WorkerFailure as failure:
            died = [line for line in str(failure).splitlines() if line.strip()]
        lines: dict[tuple[str, str], list[dict]] = {}
        for rank in (0, 1):
            path = Path(f"{prefix}.{rank}")
            for entry in (json.loads(line) for line in path.read_text().splitlines()) if path.exists() else ():
                lines.setdefault((entry["type"], entry["mode"]), []).append(entry)
        cells.update({key: cell(entries) for key, entries in lines.items()})
        crashed = re.match(r"rank (\d+) exited with code (-?\d+)", died[0]) if died else None
        if died and not (crashed and int(crashed[2]) == HANG_EXIT):  # a watchdog's exit has written its line
            # the case the dead rank (or, on the launcher's timeout, every rank) was in: its first without a line;
            # its partner's line there, if any, is the connection the crash closed
            mine = {key for key, es in lines.items() if crashed is None or any(e["rank"] == int(crashed[1])
                                                                                 for e in es)}
            first = next(((t, m) for t, modes in plan for m in modes if (t, m) not in mine), None)
            if first is not None:
                cells[first] = f"FAIL: the world died in this case: {died[0]} {died[-1]}"[:300]
        left = [(t, [m for m in modes if (t, m) not in cells]) for t, modes in plan]
        plan = [(t, modes) for t, modes in left if modes]


def counts(rows: dict[str, dict[str, str]], mode: str) -> str:
    """'N pass, F FAIL, R refused (T tiny model, P plait)' for one mode's column."""
    column = [r[mode] for r in rows.values()]
    tiny = sum(c.startswith("refused: tiny model") for c in column)
    refused = sum(c.startswith("refused") for c in column)
    return (f"{sum(c.startswith('pass') for c in column)} pass, {sum(c.startswith('FAIL') for c in column)} FAIL, "
            f"{refused} refused ({tiny} by the tiny model, {refused - tiny} by plait)")


def render(rows: dict[str, dict[str, str]], modes: tuple[str, ...], seconds: float) -> str:
    """The section: what ran and how it is judged, the counts per mode, and the table of type x mode."""
    import torch
    import transformers

    lines = [
        BEGIN,
        "## Image-text-to-text models",
        "",
        (f"Written by `scripts/vision_sweep.py` (transformers {transformers.__version__}, torch {torch.__version__}, "
         f"gloo on CPU, worlds of 2 processes on {os.cpu_count()} cores; {seconds / 60:.1f} min wall time for the "
         f"{len(rows)} types). Every image-text-to-text model type of the installed transformers "
         "(`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), made tiny by `plait_transformers.tiny_vision` (a 4-layer "
         "decoder, a 2-layer vision tower, 16x16 images in 4x4 patches), its `architectures` naming the image-text "
         "class as a whole model's checkpoint does, stochastic depth off. Modes: `tp2-sp` (tp=2 with SP), "
         "`zero3-dp2` (ZeRO-3 over 2 ranks), `pp2` (pp=2, 1F1B over 2 micro-batches), `cp2` (cp=2, the vision tower "
         "whole on each rank, the language model on its slice). Each trains 3 AdamW steps on "
         "4 rows a step, 0-2 images a row (every replica and micro-batch holding one, as ZeRO-3 needs; rows padded "
         "to a multiple of 4 tokens, as SP and cp need), through `train_step(..., images=...)` against "
         "transformers' model and "
         "torch's AdamW in one process, in fp32 and again in float64 (experts in their eager loop: torch's grouped "
         "matmul takes no float64), as tests/workers/vlm_parity.py runs its tiny types."),
        "",
        (f"pass: every fp32 loss within {FP32_LOSS:g} relative, every float64 loss within {FLOAT64_LOSS:g} (about "
         "three times the largest rounding measured across the types: Adam-grown fp32 rounding, and in float64, "
         "run float64 throughout as the conformance kit's (transformers' fp32 casts made float64), the largest "
         "difference; tests/test_vlm.py holds its families to 1e-6 and 1e-14), every "
         f"float64 gradient within {GRAD_UNITS:g} unit of 1e-6 + 1e-5·|g| at every "
         "step and rank, and the gradients compared those of every parameter the reference trains (a tied copy, "
         "the last pipeline stage's `lm_head.weight`, against its pair's). The numbers are each run's worst loss "
         "(relative) and gradient (units); fp32's gradients are shown, not bounded (Adam grows their rounding). "
         "`FAIL` names each bound missed at its worst "
         "step (1-3), or the error raised. `refused: tiny model` is `tiny_vision.check`'s reason the tiny model "
         "does not train on one process; any other refusal is plait's (a ConfigError: the layout plan's on the meta "
         "model before launch, or parallelize's or train_step's). Llama 4's forward raises after its logits unless "
         "it returns a tuple (`tiny_vision.TUPLE_FORWARD`); the worker runs it so."),
        "",
        "Per mode: " + "; ".join(f"`{m}` {counts(rows, m)}" for m in modes) + ".",
        "",
        "| model type | " + " | ".join(modes) + " |",
        "| --- | " + " | ".join("---" for _ in modes) + " |",
    ]
    for model_type, cells in rows.items():
        lines.append(f"| {model_type} | " + " | ".join(cells[m].replace("|", "\\|") for m in modes) + " |")
    return "\n".join([*lines, END]) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace the section between BEGIN and END, or add it at the end; through a rename, so an interrupted run
    leaves the file whole."""
    text = path.read_text()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text)
    temp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these types only (and in the section)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PLAIT_LAUNCH", "fork")  # ranks forked from a preloaded server: seconds per world saved
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from plait_transformers.tiny_vision import check
    from plait_transformers.vision_sweep_worker import LAYOUTS

    transformers.logging.set_verbosity_error()
    start = time.monotonic()
    modes = tuple(LAYOUTS)
    types = args.only or list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    cells: dict[tuple[str, str], str] = {}
    plan = []
    for model_type in types:
        tiny = check(model_type)
        refused = ({m: "refused: tiny model: " + tiny.removeprefix("refused: ") for m in modes} if tiny != "pass"
                   else preflight(model_type, modes))
        cells.update({(model_type, m): c for m, c in refused.items()})
        left = [m for m in modes if m not in refused]
        plan += [(model_type, left)] if left else []
        print(f"{model_type}: {tiny}; to run: {left}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="vision-sweep-") as workdir:
        for first in range(0, len(plan), TYPES_PER_WORLD):
            run_world(plan[first:first + TYPES_PER_WORLD], cells, Path(tempfile.mkdtemp(dir=workdir)))
            print(f"{min(first + TYPES_PER_WORLD, len(plan))} of {len(plan)} types run, "
                  f"{time.monotonic() - start:.0f} s", file=sys.stderr)
    rows = {t: {m: cells[(t, m)] for m in modes} for t in types}
    seconds = time.monotonic() - start
    write_section(args.out, render(rows, modes, seconds))
    for mode in modes:
        print(f"{mode}: {counts(rows, mode)}")
    for (model_type, mode), text in cells.items():
        if text.startswith("FAIL"):
            print(f"FAIL {model_type} {mode}: {text}")
    print(f"wall time {seconds:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
