"""SFT parity: prompt-masked labels, padded and packed (restarting position ids), at tp=2 + SP, pp=2 and
ZeRO-1 dp=2 against one process, for llama, gpt2 and qwen3 (generic adapter). One launch of 2 ranks
(tests/workers/sft_parity.py) runs every case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch

WORKER = str(Path(__file__).parent / "workers" / "sft_parity.py")
CASES = [f"{arch}-{layout}-{mode}" for arch in ("llama", "gpt2", "qwen3")
         for layout in ("tp2_sp", "pp2", "zero1_dp2") for mode in ("padded", "packed")]
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("sft") / "out.json"
    launch([WORKER, str(out)], 2, timeout=400)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_sft_parity(results, case):
    for rank, r in enumerate(results[case]):
        where = f"{case} rank {rank}"
        assert r["loss_rel"] <= TOL, f"{where}: loss off by {r['loss_rel']:.2e} relative ({r['losses']})"
        assert r["grads_close"] and r["checked"], \
            f"{where}: gradients off by up to {r['grad_abs']:.2e} (rtol 1e-5, atol 1e-6)"
        assert r["norm_rel"] <= TOL, f"{where}: global gradient norm off by {r['norm_rel']:.2e} relative"
        assert r["param_abs"] <= 1e-5, f"{where}: parameters after 3 steps off by {r['param_abs']:.2e}"
        # the divisor is the global batch's labelled tokens, which differ step to step (the masks are uneven)
        assert len(set(r["num_items"])) > 1
    # every parameter's gradient compared on some rank at every step (ZeRO-1: by its owner; pp: by its stage)
    assert set().union(*(r["checked"] for r in results[case])) >= set(results[case][0]["parameters"])
    if case.endswith("packed"):  # the check exercises rows holding several examples
        assert results[case][0]["packed_rows_with_several_examples"] > 0
