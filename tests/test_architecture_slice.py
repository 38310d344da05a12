"""A bounded slice of the architecture sweep in every suite run: docs/architectures.md's tp2-sp verdict (pass,
refused, n/a, FAIL) for a few architectures the suite covers nowhere else, checked by running the sweep's own
code (scripts/architecture_sweep.py) on them. The slice rotates by day over every architecture of the table,
so the table a user reads is re-proven piece by piece; PLAIT_SWEEP_SLICE=arch,arch picks one (the failure
message names the day's slice). The full table: `python scripts/architecture_sweep.py`."""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

import pytest

from releases import TRANSFORMERS
from test_generic_conformance import ARCHITECTURES as GENERIC_KIT

ROOT = Path(__file__).resolve().parent.parent
SLICE, MODE = 4, "tp2-sp"
ELSEWHERE = {*GENERIC_KIT, "llama", "gpt2", "mistral"}  # kit-tested in the suite already


def sweep_module():
    spec = importlib.util.spec_from_file_location("architecture_sweep", ROOT / "scripts" / "architecture_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def table() -> dict[str, str]:
    """architecture -> its tp2-sp cell, from docs/architectures.md."""
    text = (ROOT / "docs" / "architectures.md").read_text()
    lines = text.partition("<!-- image-text sweep: begin -->")[0].splitlines()  # the text table, not the image one
    header = next(line for line in lines if line.startswith("| architecture |"))
    column = [c.strip() for c in header.strip("|").split("|")].index(MODE)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| architecture", "| ---"))]
    split = ([c.strip().replace("\x00", "|") for c in row.replace("\\|", "\x00").strip("|").split("|")] for row in rows)
    return {cells[0]: cells[column] for cells in split}  # a cell's own "|" is written "\\|"


def todays_slice(names: list[str]) -> list[str]:
    if os.environ.get("PLAIT_SWEEP_SLICE"):
        return os.environ["PLAIT_SWEEP_SLICE"].split(",")
    start = datetime.date.today().toordinal() * SLICE % len(names)
    return [names[(start + i) % len(names)] for i in range(SLICE)]


def table_release() -> str:
    """The transformers release the table was written with (its first paragraph names it)."""
    found = re.search(r"\(transformers ([0-9.]+),", (ROOT / "docs" / "architectures.md").read_text())
    assert found, "docs/architectures.md does not name the transformers release it was written with"
    return found.group(1)


# The table is one transformers release's record: another release (scripts/test.sh --oldest) lacks some of its model
# types and runs others from earlier code, so its verdicts are not that release's to check.
TABLE_RELEASE = table_release()
of_the_tables_release = pytest.mark.skipif(
    str(TRANSFORMERS) != TABLE_RELEASE,
    reason=f"docs/architectures.md is transformers {TABLE_RELEASE}'s table; this is {TRANSFORMERS}")


def kind(cell: str) -> str:
    return cell.split(" ")[0].removesuffix(":")


@of_the_tables_release
def test_the_table_holds_for_todays_slice():
    cells = table()
    picked = todays_slice(sorted(set(cells) - ELSEWHERE))
    sweep = sweep_module()
    rows = [sweep.prepare(arch, (MODE,)) for arch in picked]
    sweep.run(rows, (MODE,))
    got = {row.architecture: row.cells.get(MODE, "not run") for row in rows}
    wrong = {arch: (cells[arch][:120], got[arch][:200]) for arch in picked if kind(got[arch]) != kind(cells[arch])}
    assert not wrong, (f"docs/architectures.md no longer holds for {sorted(wrong)} ({MODE}; table vs now: {wrong}); "
                       f"rerun with PLAIT_SWEEP_SLICE={','.join(picked)}")


@of_the_tables_release
def test_the_sweep_state_seeds_from_the_table_and_renders_it_back():
    """The sweep's state file is not committed: a partial run seeds it from docs/architectures.md, which must
    give back the table's rows as they are (and the tp2-sp verdicts ``table`` reads)."""
    sweep = sweep_module()
    state = sweep.seed_from_table(ROOT / "docs" / "architectures.md")
    seconds = state.pop("_seconds")
    seeded = {a: kind(s["cells"].get(MODE, "not run")) for a, s in state.items()}
    assert seeded == {a: kind(c) for a, c in table().items()}
    rows = [sweep.Row(a, **s) for a, s in state.items()]
    lines = sweep.text_table((ROOT / "docs" / "architectures.md").read_text()).splitlines()
    rendered = sweep.render(rows, seconds).splitlines()
    assert [x for x in rendered if x.startswith("| ")] == [x for x in lines if x.startswith("| ")]


@pytest.mark.parametrize("cell, expected", [("pass (loss 1e-07, grad 0.24)", "pass"),
                                            ("whole (model.layers.*.mamba; loss 1e-07, grad 0.24)", "whole"),
                                            ("refused: layer type 'x' ...", "refused"),
                                            ("n/a (no routed experts)", "n/a"), ("FAIL (loss ...)", "FAIL")])
def test_cell_kinds(cell, expected):
    assert kind(cell) == expected


def test_only_gradients_near_the_tolerance_go_to_the_float64_recheck():
    """The kit (and so the sweep) reruns a failed fp32 pair in float64 (which decides) only where every loss was right
    and the gradients were off after step 1, or at step 1 by at most ``STEP1_NOISE`` tolerances (Gemma 4's own fp32
    noise); a gradient off by more at step 1, or a wrong loss, is a FAIL outright."""
    from plait.testing.noise import fp32_noise, noise_note, noise_shaped

    def result(note: str, loss: float = 1e-7, status: str = "FAIL", dtype: str = "float32"):
        return types.SimpleNamespace(note=note, loss_rel=loss, grad_tol=5.0, status=status, dtype=dtype)

    near = "step 1 grad a: max |Δ| 5e-06 (2.2e+00x tolerance); step 1 grad b: max |Δ| 9e-06 (4.7e+00x tolerance)"
    assert fp32_noise(result("step 2 grad w: max |Δ| 3e-05 (3.0e+00x tolerance)"))
    assert fp32_noise(result("step 4 grad w: max |Δ| 3e-04 (3.1e+01x tolerance)"))  # ZeRO-2/3 modes: 4 steps
    assert fp32_noise(result(near))
    assert noise_note(near) == "step 1 grad a 2.2x the tolerance"
    assert not fp32_noise(result(near + "; step 1 grad c: max |Δ| 2e-04 (4.0e+01x tolerance)"))
    assert not fp32_noise(result(near, loss=1e-3))
    assert not fp32_noise(result("step 2 grad w: max |Δ| 3e-05 (3.0e+00x tolerance)", dtype="float64"))
    assert not fp32_noise(result("", status="pass"))
    # the suite's parity workers (cp, the MoE global aux loss) apply the rule to the failures of all their ranks
    assert noise_shaped(["step 3 grad v: max |diff| 2e-06 (3.10x tolerance)", "step 2 grad w: max |diff| 1.7e-06 "
                                                                             "(1.45x tolerance)"])
    assert noise_shaped(near.split("; "))
    assert not noise_shaped([*near.split("; "), "step 1 grad c: max |Δ| 2e-04 (4.0e+01x tolerance)"])
    assert not noise_shaped(["step 2 grad w: max |Δ| 3e-05 (3.0e+00x tolerance)", "step 3 loss 4.1 vs 4.2 (rel 2e-2)"])
    assert not noise_shaped(["step 2 grad w: plait has none"]) and not noise_shaped([])


def test_tp_cells_say_whether_the_plan_split_the_blocks_or_kept_them_whole():
    """What a tp plan keeps whole on every rank (WholeSequence rules) is read off the layout plan of the meta model,
    not a list: JetMoE's attention and MoE block, a recurrent mixer; Llama's plan splits everything. A tp cell that
    passed says which ("whole (M; ...)" or "pass (...)"), the relabel keeps the numbers, and the summary counts only
    split cells toward tp."""
    sweep = sweep_module()
    jetmoe, qwen3 = sweep.prepare("jetmoe", ("tp2-sp",)), sweep.prepare("qwen3", ("tp2-sp",))
    assert jetmoe.whole["tp2-sp"] == ("model.layers.*.mlp", "model.layers.*.self_attention")
    assert qwen3.whole["tp2-sp"] == () and "tp2-sp" not in qwen3.cells  # planned, to run
    cell = sweep.label("pass (loss 1e-07, grad 0.02)", jetmoe.whole["tp2-sp"])
    assert cell == "whole (model.layers.*.mlp, model.layers.*.self_attention; loss 1e-07, grad 0.02)"
    assert sweep.recorded_whole(cell) == jetmoe.whole["tp2-sp"]
    assert sweep.label(cell, ()) == "pass (loss 1e-07, grad 0.02)" and sweep.label("FAIL (x)", ("m",)) == "FAIL (x)"
    assert sweep.tp_modes() == ("tp2-sp", "consolidate-tp2-sp")
    rows = [sweep.Row("a", cells={"tp2-sp": cell}, passed={"tp2-sp": True}),
            sweep.Row("b", cells={"tp2-sp": "pass (loss 0e+00, grad 0.1)"}, passed={"tp2-sp": True}),
            sweep.Row("c", cells={"tp2-sp": "refused: no"}, passed={"tp2-sp": False})]
    assert sweep.column_counts(rows, "tp2-sp") == "1 split, 1 whole, 1 refused, 0 fail or not run"
    assert sweep.column_counts(rows, "cp2") == "0 pass, 0 refused, 3 fail or not run"


def test_relabel_names_cells_measured_with_other_plans(monkeypatch):
    """The relabel trains nothing: a cell whose plan now keeps other modules whole, or that the plan now refuses or
    no longer refuses, is named for a rerun rather than relabelled with numbers of another plan."""
    sweep = sweep_module()
    plans = {"x": sweep.Row("x", whole={"tp2-sp": ("m.*.attn",), "consolidate-tp2-sp": ("m.*.attn",)}),
             "y": sweep.Row("y", cells={"tp2-sp": "refused: no", "consolidate-tp2-sp": "refused: no"})}
    monkeypatch.setattr(sweep, "prepare", lambda arch, modes: plans[arch])
    state = {"x": {"cells": {"tp2-sp": "pass (loss 1, grad 2)", "consolidate-tp2-sp": "whole (m.*.mlp; loss 1)"},
                   "passed": {"tp2-sp": True, "consolidate-tp2-sp": True}},
             "y": {"cells": {"tp2-sp": "pass (loss 1)", "consolidate-tp2-sp": "refused: old"},
                   "passed": {"tp2-sp": True, "consolidate-tp2-sp": False}}}
    stale = sweep.relabel(state, ["x", "y"])
    assert state["x"]["cells"] == {"tp2-sp": "whole (m.*.attn; loss 1, grad 2)",
                                   "consolidate-tp2-sp": "whole (m.*.mlp; loss 1)"}
    assert state["y"]["cells"] == {"tp2-sp": "refused: no", "consolidate-tp2-sp": "refused: no"}
    assert stale == ["x consolidate-tp2-sp (whole m.*.mlp -> m.*.attn)", "y tp2-sp (pass -> refused)"]
