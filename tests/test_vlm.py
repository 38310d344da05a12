"""Image-text-to-text models (issue 49): built and planned as transformers builds them, trained through
``ParallelModel.train_step(..., images=...)`` with one process's losses and gradients.

One world of 2 (tests/workers/vlm_parity.py) trains a tiny LLaVA (CLIP tower, projector, Llama decoder) 3 AdamW steps
at tp=2 with and without SP (the vision tower whole on each tp rank), dp=2, ZeRO-1, ZeRO-2 and ZeRO-3 at dp=2, dp=2
with 2 micro-batches, pp=2 (1F1B, and GPipe over 4 micro-batches) and cp=2 (all-to-all and ring: the features merged
into the whole sequence, each cp rank's text model on its slice), on rows of 0, 1 or 2 images, with a replica
holding none at the last step (under ZeRO-2/3 every replica holds one: FSDP refuses otherwise, in one line on every
rank); and the generic adapter's tiny Idefics3, Gemma 3 and Qwen2-VL at tp=2 + SP, ZeRO-3 and micro-batches, in fp32
and rechecked in float64."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.base.config import ConfigError
from plait.base.images import ImageBatch
from plait.testing import launch
from workers.vlm_parity import LAYOUTS, TINY, TINY_LAYOUTS

WORKER = str(Path(__file__).parent / "workers" / "vlm_parity.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vlm") / "out.json"
    launch([WORKER, str(out)], 2, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llava_trains_as_one_process_on_every_served_layout(results, layout):
    got = results[f"llava-{layout}"]
    for step, (loss, expected) in enumerate(zip(got["losses"], got["ref_losses"], strict=True)):
        assert loss == pytest.approx(expected, rel=1e-6), step  # measured: 1.1e-7 at most
    assert got["grad_error"] <= 1.0, got["grad_error"]  # 1e-6 + 1e-5 |g| at every step, rank and element (0.15)
    assert got["compared"] == results["parameters"]  # every trained parameter, vision tower and projector too


@pytest.mark.parametrize("model_type", TINY)
@pytest.mark.parametrize("layout", TINY_LAYOUTS)
def test_idefics3_gemma3_and_qwen2_vl_train_as_one_process(results, model_type, layout):
    """fp32's losses agree; its gradients, after Adam grows the rounding (gemma3's projector at 11 units under SP),
    are held in float64, where every layout is one process's at every step."""
    fp32, fp64 = results[f"{model_type}-{layout}"], results[f"{model_type}-{layout}-float64"]
    for got in (fp32, fp64):
        assert got["compared"] == results[f"{model_type}-parameters"]
    for loss, expected in zip(fp32["losses"], fp32["ref_losses"], strict=True):
        assert loss == pytest.approx(expected, rel=1e-6)  # measured: 3.5e-7 at most
    for loss, expected in zip(fp64["losses"], fp64["ref_losses"], strict=True):
        assert loss == pytest.approx(expected, rel=1e-9)  # measured: 2.6e-10 at most (gemma3's fp32 norms)
    assert max(fp64["grad_error_by_step"]) <= 1.0, fp64["grad_error_by_step"]  # measured: 0.031 at most


@pytest.mark.parametrize("case, message", [
    ("zero3_no_image", "under ZeRO-3 every micro-batch needs an image (FSDP reduces the vision tower's gradients "
                       "only where it ran), but micro-batch 0 of replica 0 has none; mix the image rows over the "
                       "batch, or use ZeRO-1"),
    ("qwen2_vl_pp2", "image inputs under pp=2: Qwen2VLForConditionalGeneration's later stages would not see its "
                     "multimodal rotary positions (computed from the images' grids), which only the first stage gets; "
                     "use tp, cp, dp and ZeRO for it"),
    ("gemma3_pp2", "image inputs under pp=2: Gemma3ForConditionalGeneration's later stages would not see its "
                   "per-token token_type_ids, which only the first stage gets; use tp, cp, dp and ZeRO for it"),
])
def test_what_is_not_served_is_refused_on_every_rank(results, case, message):
    """Before any collective, alike on every rank."""
    assert results[f"refused-{case}"] == [message, message]


def test_an_image_batch_is_cut_by_rows():
    pixels = torch.arange(5).view(5, 1).float()  # the images of rows 0 (one), 1 (none), 2 (two), 3 (two)
    batch = ImageBatch({"pixel_values": pixels, "image_sizes": pixels.long()}, torch.tensor([1, 0, 2, 2]))
    assert batch.take(slice(1, 3)).tensors["pixel_values"].flatten().tolist() == [1.0, 2.0]
    assert [b.tensors["image_sizes"].flatten().tolist() for b in batch.chunk(2)] == [[0], [1, 2, 3, 4]]
    assert batch.take(slice(1, 2)).inputs() == {}  # a text-only row: the model runs as a text model
    # Qwen-VL's flattened patches beside per-image grids: the patch tensor is cut by each image's patch count
    grids = torch.tensor([[1, 2, 2], [1, 2, 1], [1, 1, 1]])
    patches = ImageBatch({"pixel_values": torch.arange(7).view(7, 1), "image_grid_thw": grids},
                         torch.tensor([2, 1]), patches=grids.prod(-1))
    second = patches.take(slice(1, 2))
    assert second.tensors["pixel_values"].flatten().tolist() == [6]
    assert second.tensors["image_grid_thw"].tolist() == [[1, 1, 1]]
    with pytest.raises(ConfigError, match=r"^image input 'pixel_values' has 3 entries along its first dimension, "
                                          r"but the rows hold 2 images \(images per row: \[1, 1\]\)$"):
        ImageBatch({"pixel_values": torch.zeros(3, 1)}, torch.tensor([1, 1]))


def test_an_image_text_model_is_built_as_transformers_builds_it():
    from transformers import AutoConfig, Llama4Config, LlavaConfig

    from plait.base.meta import build_meta_model, causal_lm_refusal, takes_images

    assert type(build_meta_model(LlavaConfig())).__name__ == "LlavaForConditionalGeneration"
    text_only = Llama4Config()  # AutoModelForCausalLM builds its text decoder, as before
    whole = Llama4Config(architectures=["Llama4ForConditionalGeneration"])  # a checkpoint of the whole model
    assert (takes_images(text_only), takes_images(whole), takes_images(AutoConfig.for_model("llama"))) == \
        (False, True, False)
    assert causal_lm_refusal(LlavaConfig()) is None
    assert causal_lm_refusal(AutoConfig.for_model("bert")) == (
        "bert is an encoder-only model (its causal-LM head runs only with is_decoder=true in the config); plait "
        "trains decoder-only causal LMs")
