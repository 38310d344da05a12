"""Image-text models whose processor declares a video part (Qwen2-VL here; Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision and
SmolVLM alike) train without torchvision, which that part needs and which does not load beside a CPU build of torch:
transformers' AutoProcessor refuses the whole processor, plait loads it without its video part
(plait.data.processors) and trains on image rows as with the whole one.

A tiny Qwen2-VL (M-RoPE positions from its image grid, per-token ``mm_token_type_ids``) saved with its processor's
files as a checkpoint has them: its image processor's config, tokenizer, chat template. DPO on its image-text pairs is
held to TRL 1.16's DPOTrainer given the same processor, step by step, and a GRPO step on fixed completions to its
GRPOTrainer's loss; a run's checkpoint ships the processor, which ``plait consolidate``'s directory loads again.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle
import random
import shutil

import pytest
import torch
from test_dpo import worst
from test_dpo_vlm import ANSWERS, flags, trl_history
from test_grpo_vlm import REWARDS, ROWS, step_matches_trls
from test_vision_data import ImageOnlyQwen2VL, picture, template, tokenizer

from plait.data.processors import load_processor
from plait.data.vision import VisionEncoder
from plait.run.train_args import TrainArgs
from plait.run.trainer import Trainer

STEPS = 3
SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny Qwen2-VL and its processor's files (no video part: transformers cannot build one here), pictures of
    two sizes and TRL's vision preference rows."""
    from plait_transformers.tiny_vision import tiny_image_text_config
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    root = tmp_path_factory.mktemp("qwen2-vl")
    model = root / "model"
    tok = tokenizer(*SPECIALS)
    config = tiny_image_text_config("qwen2_vl")
    config.text_config.vocab_size = len(tok)
    config.vision_start_token_id, config.image_token_id, config.vision_end_token_id = (
        tok.convert_tokens_to_ids(token) for token in SPECIALS)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(model)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                             max_pixels=1024).save_pretrained(model)
    tok.save_pretrained(model)
    (model / "chat_template.jinja").write_text(template("".join(SPECIALS)))
    (model / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    for seed in range(3):
        picture(seed, 12 + 8 * seed, 20).save(root / f"{seed}.png")  # grids of 1 x 2 x 3, 1 x 4 x 3, 1 x 4 x 5 ...
    rng = random.Random(0)
    rows = []
    for i in range(16):
        chosen, rejected = rng.sample(ANSWERS, 2)
        rows.append({"prompt": [{"role": "user", "content": f"what is in the picture {i}"}],
                     "chosen": [{"role": "assistant", "content": chosen}],
                     "rejected": [{"role": "assistant", "content": rejected}],
                     "images": [f"{i % 3}.png"] + ([f"{(i + 1) % 3}.png"] if i % 4 == 1 else [])})
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:12]))
    (root / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[12:]))
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))  # GRPO's
    (root / "rewards.py").write_text(REWARDS)
    return root


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="torchvision is installed: the whole processor loads (this case is a machine without it)")
def test_the_processor_loads_without_its_video_part(root, tmp_path):
    """AutoProcessor refuses the directory (its video processor needs torchvision); plait's is a Qwen2VLProcessor
    with the PIL image processor and no video part, encodes rows as the processor built by hand does, copies and
    pickles as one (the pixel loader keeps a copy), and loads again from what it saves and from a checkpoint that
    names no processor class (the model type's is taken)."""
    from transformers import AutoProcessor

    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        AutoProcessor.from_pretrained(root / "model", local_files_only=True)
    processor = load_processor(root / "model")
    assert type(processor).__name__ == "Qwen2VLProcessor" and not hasattr(processor, "video_processor")
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    by_hand = ImageOnlyQwen2VL(processor.image_processor, tokenizer(*SPECIALS), chat_template=template("".join(SPECIALS)))
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the picture"}]},
                        {"role": "assistant", "content": "blue"}], "images": ["1.png"]}
    for other in (by_hand, copy.deepcopy(processor), pickle.loads(pickle.dumps(processor))):
        got, expected = (VisionEncoder(p, root).encode(row, "row") for p in (processor, other))
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.labels, expected.labels)
        assert got.pixels.keys() == expected.pixels.keys() == {"pixel_values", "image_grid_thw"}
        assert all(torch.equal(got.pixels[k], expected.pixels[k]) for k in got.pixels)
        assert torch.equal(got.tokens["mm_token_type_ids"], expected.tokens["mm_token_type_ids"])
    processor.save_pretrained(tmp_path / "saved")
    assert type(load_processor(tmp_path / "saved")).__name__ == "Qwen2VLProcessor"
    # what it saved names the video part's config, as the checkpoint did: only the library is missing to build it
    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        AutoProcessor.from_pretrained(tmp_path / "saved", local_files_only=True)
    shutil.copytree(root / "model", tmp_path / "unnamed")
    (tmp_path / "unnamed" / "processor_config.json").unlink()
    for name in ("preprocessor_config.json", "tokenizer_config.json"):
        values = json.loads((tmp_path / "unnamed" / name).read_text())
        values.pop("processor_class", None)
        (tmp_path / "unnamed" / name).write_text(json.dumps(values))
    assert type(load_processor(tmp_path / "unnamed")).__name__ == "Qwen2VLProcessor"


def test_dpo_matches_trls_dpo_trainer_and_its_checkpoint_ships_the_processor(root, tmp_path):
    """Each step's loss and TRL's metrics, and the evaluation, equal TRL's DPOTrainer's on the same pairs (a prompt's
    image grid sets the policy's and the reference's M-RoPE positions in both); the consolidated run loads as a model
    and its processor, again without the video part."""
    from test_grpo_vlm import consolidated_processor

    trainer = Trainer(TrainArgs(**flags(root, output_dir=str(tmp_path / "plait"), max_steps=STEPS, save_final=True)))
    got = trainer.train()
    expected = trl_history(root, tmp_path / "trl")
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    difference, where = worst(got, expected)
    assert difference <= 5e-7, where  # measured: 1.7e-7 (step 2's loss)
    assert got[-1]["rewards/margins"] != 0.0 and "eval_loss" in got[-1]
    processor = consolidated_processor(tmp_path / "plait", f"checkpoint-{STEPS}", load_processor)
    assert type(processor).__name__ == "Qwen2VLProcessor" and processor.image_token == "<|image_pad|>"


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_grpo_step_on_fixed_completions_is_trls(root, loss_type):
    """GRPO's loss, every gradient and its KL equal TRL's ``_compute_loss`` given this processor's pixels, image grids
    and token types (test_grpo_vlm's step, for a model whose positions follow its images' grids)."""
    # the merger moved by 0.05 gave a KL of 3.5e-4, by 0.2 or 0.5 5.8e-4: the tiny decoder reads its images little
    step_matches_trls(root, loss_type, "visual.merger", noise=0.2, kl_above=3e-4)
