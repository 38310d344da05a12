"""ParallelModel.generate: KV-cached decoding from a laid-out model's shards, the same tokens as one process (issue 48).

One world of 2 ranks runs every case (tests/workers/generate_worker.py): greedy decoding equals transformers'
``generate`` on one process token for token, and sampling (temperature, top-k, top-p, a seed) gives one process's
tokens, on every rank (tp, dp, ZeRO-1/2/3, ep), with left-padded prompts of different lengths and an EOS that ends
rows early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch
from workers.generate_worker import CASES, EOS, PAD

WORKER = str(Path(__file__).parent / "workers" / "generate_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("generate")
    launch([WORKER, str(out)], 2, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_generates_one_process_tokens(ranks, case):
    for rank, results in enumerate(ranks):
        got = results[case]
        assert got["greedy"] == got["one_process"]["greedy"], f"{case} rank {rank}: greedy differs"
        assert got["sampled"] == got["one_process"]["sampled"], f"{case} rank {rank}: sampled differs"
        assert got["still_training"], f"{case} rank {rank}: the model was left in eval mode"
    sampled, greedy = ranks[0][case]["sampled"], ranks[0][case]["greedy"]
    assert sampled != greedy  # sampling drew something else than the argmax
    if "-lora-" not in case:  # the adapters move the tokens off the base's; its EOS path is checked on the base
        assert any(EOS in row[9:] and row[-1] == PAD for row in sampled + greedy), "no row ended at EOS"


def test_what_is_not_served_is_refused_in_one_line(ranks):
    said = ranks[0]["refusals"]
    assert said["vpp"] == "generation with pp=2 and 2 stages a rank is not served yet; use --virtual_pipeline_size 1", \
        said["vpp"]
    assert said["odd-batch"] == "generation of a batch of 3 prompts over dp=2 replicas: the batch must be a " \
        "multiple of dp", said["odd-batch"]
