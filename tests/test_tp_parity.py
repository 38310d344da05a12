"""TP / SP / DP parity of every built-in adapter against one process (gloo, fp32, 3 AdamW steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch
from workers.tp_parity import CASES

WORKER = str(Path(__file__).parent / "workers" / "tp_parity.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Launch one world per size (2 and 4 ranks); every case of that size runs inside it."""
    by_case: dict[str, list[dict]] = {}
    for world in sorted({w for w, *_ in CASES.values()}):
        out = tmp_path_factory.mktemp(f"tp{world}")
        launch([WORKER, str(out)], world, timeout=240)
        for rank in range(world):
            for name, result in json.loads((out / f"rank{rank}.json").read_text()).items():
                by_case.setdefault(name, []).append(result)
    return by_case


@pytest.mark.parametrize("case", list(CASES))
def test_parity(results, case):
    for rank, result in enumerate(results[case]):
        assert not result["failures"], f"{case} rank {rank}: {result['failures']}"
        assert result["loss_rel"] <= 1e-5
        assert result["grad_err"] <= 1e-5
        assert result["param_err"] <= 1e-5, f"{case} rank {rank}: parameters drifted by {result['param_err']}"
        assert result["logits_err"] <= 1e-5
        if case.startswith(("llama-tp2", "mistral-tp2")):  # shards joined by torch.distributed, not plait's helpers
            assert result["shards_checked"] == result["parameters"] > 0, result
