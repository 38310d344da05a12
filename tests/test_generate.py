"""ParallelModel.generate: KV-cached decoding from a laid-out model's shards, the same tokens as one process (issue 48).

One world of 2 ranks runs every case (tests/workers/generate_worker.py): greedy decoding equals transformers'
``generate`` on one process token for token, and sampling (temperature, top-k, top-p, a seed) gives one process's
tokens, on every rank (tp, dp, ZeRO-1/2/3, ep, pp, cp, LoRA), with left-padded prompts of different lengths and an
EOS that ends rows early; for Llama also an EOS that every row meets early, where the batch stops as transformers'
does. A world of 4 adds pp=4 (middle stages), pp=2 x dp=2 and pp=2 x tp=2 with SP. Mistral's sliding window of 6
(its mask counts cache entries) under SP, in both worlds: each step's pads come after its token and leave the
cache (before, they filled the window: other tokens than one process's); Llama 4's chunked attention under SP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch
from workers.generate_worker import CASES, CASES_4, EOS, LONG, PAD

WORKER = str(Path(__file__).parent / "workers" / "generate_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("generate")
    launch([WORKER, str(out)], 2, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def ranks_4(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("generate4")
    launch([WORKER, str(out)], 4, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.parametrize("case", [*CASES, *CASES_4])
def test_every_layout_generates_one_process_tokens(request, case):
    ranks = request.getfixturevalue("ranks_4" if case in CASES_4 else "ranks")
    for rank, results in enumerate(ranks):
        got = results[case]
        assert got["greedy"] == got["one_process"]["greedy"], f"{case} rank {rank}: greedy differs"
        assert got["sampled"] == got["one_process"]["sampled"], f"{case} rank {rank}: sampled differs"
        assert got["still_training"], f"{case} rank {rank}: the model was left in eval mode"
    sampled, greedy = ranks[0][case]["sampled"], ranks[0][case]["greedy"]
    assert sampled != greedy  # sampling drew something else than the argmax
    if "all_stop" in ranks[0][case]:  # every row at EOS early: the batch stops where transformers' does
        for rank, results in enumerate(ranks):
            stop = results[case]["all_stop"]
            assert stop["got"] == stop["expected"], f"{case} rank {rank}: early stop differs"
            assert len(stop["got"][0]) < 9 + LONG, "the batch did not stop early"
            # transformers' stopping criteria (a stop string's, here token pairs) end rows as its generate ends them
            assert stop["criteria_got"] == stop["criteria_expected"], f"{case} rank {rank}: criteria stop differs"
        stop = ranks[0][case]["all_stop"]
        assert len(stop["criteria_got"][0]) < 9 + LONG, "the batch did not stop early"
        assert any(ended_by(row[9:], stop["tails"]) for row in stop["criteria_got"]), "no row ended at its criterion"
    elif "-lora-" not in case:  # some rows at EOS (LoRA's EOS path is checked on its base)
        assert any(EOS in row[9:] and row[-1] == PAD for row in sampled + greedy), "no row ended at EOS"


def ended_by(new: list[int], tails: list[list[int]]) -> bool:
    """Whether a row's new tokens end with one of ``tails`` and then pads (a criterion ended the row there)."""
    at = new.index(PAD) if PAD in new else None
    return at is not None and any(new[max(0, at - len(tail)): at] == tail for tail in tails)


def test_what_is_not_served_is_refused_in_one_line(ranks):
    said = ranks[0]["refusals"]
    assert said["odd-batch"] == "generation of a batch of 3 prompts over dp=2 replicas: the batch must be a " \
        "multiple of dp", said["odd-batch"]
