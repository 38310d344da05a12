"""Tiny image-text-to-text models (plait_transformers.tiny_vision): each of the architectures the parity tests and
the sweep's image-text column start from builds under the tiny-model budget, trains one step on rows of 1, 2, 0 and
1 images with a finite loss and gradients, and its batch labels text only and carries no pixels for a row without
images. The table over every installed type: ``python -m plait_transformers.tiny_vision`` (about 25 s)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from plait_transformers import MAX_TINY_PARAMETERS
from plait_transformers.tiny_vision import IMAGE_KEYS, check, image_text_batch, tiny_image_text_config

# the four first, then the others it names that pass in well under a second each
TYPES = ["llava", "idefics3", "gemma3", "qwen2_vl", "llava_next", "smolvlm", "paligemma", "qwen2_5_vl", "qwen3_vl",
         "mistral3", "aya_vision", "internvl", "llama4"]


def _image_token(config) -> int:
    return next(getattr(config, k) for k in IMAGE_KEYS if isinstance(getattr(config, k, None), int))


@pytest.mark.parametrize("model_type", TYPES)
def test_the_tiny_model_trains_on_image_text_rows(model_type):
    assert check(model_type) == "pass"


@pytest.mark.parametrize("model_type", TYPES)
def test_the_tiny_model_is_under_the_budget(model_type):
    config = tiny_image_text_config(model_type)
    assert config.text_config.vocab_size <= 128
    count = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    assert count < MAX_TINY_PARAMETERS, count


@pytest.mark.parametrize("model_type", TYPES)
def test_labels_sit_on_text_only_and_text_only_rows_carry_no_pixels(model_type):
    config = tiny_image_text_config(model_type)
    image = _image_token(config)
    input_ids, attention_mask, labels, pixels, extras = image_text_batch(config, [1, 2, 0, 1], text=6, seed=3)
    assert input_ids.shape == attention_mask.shape == labels.shape
    assert (labels[input_ids == image] == -100).all()
    assert (labels[attention_mask == 0] == -100).all()
    assert ((labels != -100).sum(1) == 6).all()  # every text token, and nothing else
    per_image = int((input_ids[0] == image).sum())
    assert per_image > 0 and (input_ids == image).sum(1).tolist() == [per_image, 2 * per_image, 0, per_image]
    for counted in ("image_seq_length", "mm_tokens_per_image"):  # the config's own count agrees with the tower
        assert getattr(config, counted, None) in (None, per_image), counted
    assert all(v.shape == input_ids.shape for v in extras.values())
    assert image_text_batch(config, [0, 0])[3] == {}  # no images: the model runs as a text model
    grid = pixels.get("image_grid_thw")
    images = len(grid) if grid is not None else len(pixels["pixel_values"])
    assert images == 4  # by image along dim 0: 1 + 2 + 0 + 1
    again = image_text_batch(config, [1, 2, 0, 1], text=6, seed=3)
    assert torch.equal(again[0], input_ids) and torch.equal(again[3]["pixel_values"], pixels["pixel_values"])


def test_an_encoder_decoder_type_is_refused_in_one_line():
    result = check("t5gemma2")
    assert result.startswith("refused: config: ValueError: encoder-decoder model") and "\n" not in result
