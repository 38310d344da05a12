"""A bounded slice of the architecture sweep in every suite run: docs/architectures.md's tp2-sp verdict (pass,
refused, n/a, FAIL) for a few architectures the suite covers nowhere else, checked by running the sweep's own
code (scripts/architecture_sweep.py) on them. The slice rotates by day over every architecture of the table,
so the table a user reads is re-proven piece by piece; PLAIT_SWEEP_SLICE=arch,arch picks one (the failure
message names the day's slice). The full table: `python scripts/architecture_sweep.py`."""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

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
    lines = (ROOT / "docs" / "architectures.md").read_text().splitlines()
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


def kind(cell: str) -> str:
    return cell.split(" ")[0].removesuffix(":")


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


def test_the_sweep_state_seeds_from_the_table_and_renders_it_back():
    """The sweep's state file is not committed: a partial run seeds it from docs/architectures.md, which must
    give back the table's rows as they are (and the tp2-sp verdicts ``table`` reads)."""
    sweep = sweep_module()
    state = sweep.seed_from_table(ROOT / "docs" / "architectures.md")
    seconds = state.pop("_seconds")
    seeded = {a: kind(s["cells"].get(MODE, "not run")) for a, s in state.items()}
    assert seeded == {a: kind(c) for a, c in table().items()}
    rows = [sweep.Row(a, **s) for a, s in state.items()]
    lines = (ROOT / "docs" / "architectures.md").read_text().splitlines()
    rendered = sweep.render(rows, seconds).splitlines()
    assert [x for x in rendered if x.startswith("| ")] == [x for x in lines if x.startswith("| ")]


@pytest.mark.parametrize("cell, expected", [("pass (loss 1e-07, grad 0.24)", "pass"),
                                            ("refused: layer type 'x' ...", "refused"),
                                            ("n/a (no routed experts)", "n/a"), ("FAIL (loss ...)", "FAIL")])
def test_cell_kinds(cell, expected):
    assert kind(cell) == expected


def test_only_gradients_near_the_tolerance_go_to_the_float64_recheck():
    """The kit (and so the sweep) reruns a failed fp32 pair in float64 (which decides) only where every loss was right
    and the gradients were off after step 1, or at step 1 by at most ``STEP1_NOISE`` tolerances (Gemma 4's own fp32
    noise); a gradient off by more at step 1, or a wrong loss, is a FAIL outright."""
    from plait.testing.noise import fp32_noise, noise_note

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
