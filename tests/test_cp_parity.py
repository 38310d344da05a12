"""Context parallelism against one process (gloo, 3 AdamW steps): every case of tests/workers/cp_parity.py.

At every step every rank compares the loss and the gradient of each parameter it steps on (its tp slice, its
pipeline stage, its ZeRO-1 share or its ZeRO-2/3 rows) with the same slice of the reference's, and the ranks
together must have compared every parameter of the model, by full name, at every step. A case runs in float32, or
in float64 where the worker's FLOAT64 records that fp32 rounding, amplified by Adam, was measured to exceed the
tolerance or come within 2x of it; an fp32 case whose failures are shaped like that rounding is decided in float64
(``plait.testing.noise.noise_shaped``). The worlds: 2 ranks (cp=2), 4 ranks (cp=4; cp2 x tp2; cp2 x pp2 under each
pipeline schedule; cp2 x dp2 under ZeRO-1, 2 and 3), one launch each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from plait.base.pipeline_schedules import SCHEDULES
from plait.testing import launch
from workers.cp_parity import CASES, STEPS

WORKER = str(Path(__file__).parent / "workers" / "cp_parity.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """One launch per world size, every case of it: {case: [result per rank]}."""
    found: dict[str, list[dict]] = {}
    for world in sorted({w for w, *_ in CASES.values()}):
        out = tmp_path_factory.mktemp(f"cp{world}")
        launch([WORKER, str(out)], world, timeout=400)
        for rank in range(world):
            for name, result in json.loads((out / f"rank{rank}.json").read_text()).items():
                found.setdefault(name, []).append(result)
    return found


def step_of(failure: str) -> int:
    """The step a worker's failure names ("step 2 grad NAME: ..."), STEPS + 1 for one after training."""
    found = re.match(r"step (\d+) ", failure)
    return int(found.group(1)) if found else STEPS + 1


@pytest.mark.parametrize("case", list(CASES))
def test_cp_parity(results, case):
    ranks = results.get(case, [])
    assert len(ranks) == CASES[case][0], f"{case}: {len(ranks)} of {CASES[case][0]} ranks reported"
    found = sorted(((step_of(failure), rank, failure) for rank, result in enumerate(ranks)
                    for failure in result["failures"]), key=lambda found: found[:2])  # by step, then rank
    if found:
        first = found[0][0]
        lines = [f"{case} rank {rank} ({ranks[rank]['coords']}, {ranks[rank]['dtype']}): {failure}"
                 for _, rank, failure in found]
        more = sum(result["more_failures"] for result in ranks)
        pytest.fail(f"{case}: ranks {sorted({rank for _, rank, _ in found})} of {len(ranks)} failed, first at "
                    f"step {first} on ranks {sorted({rank for step, rank, _ in found if step == first})}\n"
                    + "\n".join(lines) + (f"\n... and {more} more" if more else ""), pytrace=False)
    parameters, names = set(ranks[0]["parameters"]), set(ranks[0]["aliases"])
    for step in range(STEPS):
        compared = set().union(*(result["checked"][step] for result in ranks))
        assert not parameters - compared, \
            f"{case} step {step + 1}: no rank compared the gradients of {sorted(parameters - compared)}"
        assert compared <= names, f"{case} step {step + 1}: compared unknown parameters {sorted(compared - names)}"


def test_cases_cover_the_layouts():
    """The layouts context parallelism composes with, each in some case: cp=4, cp x tp, cp x pp under every
    pipeline schedule, cp x dp under ZeRO-1, 2 and 3."""
    layouts = [layout for _, _, layout, _, _ in CASES.values()]
    assert any(layout["cp"] == 4 for layout in layouts)
    assert any(layout.get("tp", 1) > 1 for layout in layouts)
    schedules = {layout.get("pipeline_schedule", "1f1b") for layout in layouts if layout.get("pp", 1) > 1}
    assert schedules == set(SCHEDULES), f"cp x pp lacks {sorted(set(SCHEDULES) - schedules)}"
    zero = {layout.get("zero_stage", 1 if layout.get("zero_1") else 0) for world, _, layout, _, _ in CASES.values()
            if world > layout["cp"] * layout.get("tp", 1) * layout.get("pp", 1)}  # dp > 1
    assert {1, 2, 3} <= zero, f"cp x dp lacks ZeRO stages {sorted({1, 2, 3} - zero)}"
