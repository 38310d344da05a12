"""``ParallelModel.generate`` with images: an image-text model's prompts completed from its shards, the images read by
the prompts' forward (plait.generation.images). One world of 2 (tests/workers/vlm_generate.py): a tiny LLaVA on every
layout that serves it, Idefics3, Gemma 3, Qwen2-VL and Qwen3-VL (grid positions, deepstack) on one to three, greedy
equal to transformers' ``generate`` with the same pixels on one process and sampled equal to the same decoding in one
process, on every rank; what is not served is refused in one line before any collective."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.testing import launch
from workers.vlm_generate import FAMILIES, LLAVA

WORKER = str(Path(__file__).parent / "workers" / "vlm_generate.py")
CASES = [("llava", name) for name in LLAVA] + [(family, name) for family, names in FAMILIES.items()
                                                 for name in names]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("vlm_generate") / "out.json"
    launch([WORKER, str(out)], 2, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("model, layout", CASES)
def test_every_layout_completes_image_prompts_as_one_process(ranks, model, layout):
    for rank, results in enumerate(ranks):
        expected, got = results[model]["one_process"], results[model][layout]
        assert got["greedy"] == expected["greedy"], (rank, got["greedy"], expected["greedy"])
        assert got["sampled"] == expected["sampled"], (rank, got["sampled"], expected["sampled"])
    assert ranks[0][model]["one_process"]["sampled"] != ranks[0][model]["one_process"]["greedy"]


def test_images_generation_does_not_serve_are_refused_in_one_line(ranks):
    said = ranks[0]["refusals"]
    assert all(r["refusals"] == said for r in ranks)  # every rank alike
    expected = {
        "pp2_deepstack": "image inputs under pp: Qwen3VLForConditionalGeneration adds visual tokens after its first "
                         "1 decoder layers, inside its first pipeline stage only",
        "zero3_replica_without_images": "ZeRO-3: prompts 0 to 1 of the batch hold no image, and every replica's "
                                        "prompts of a batch need one (the vision tower's shards are gathered by every "
                                        "replica together)",
        "rows": "generation was given the images of 4 rows for a batch of 2 prompts",
        "text_model": "generation was given images, but LlamaForCausalLM is a text model",
    }
    assert said.keys() == expected.keys()
    for name, start in expected.items():
        assert said[name] and said[name].startswith(start) and "\n" not in said[name], (name, said[name])
