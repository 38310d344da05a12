"""``plait generate`` for an image-text model: prompts in TRL's vision format (``messages`` with image parts beside
``images``) encoded by the model's processor, as training encodes rows, their pixels reaching the prompts' forward.
A tiny LLaVA with its processor: one process equals transformers' ``generate`` on each prompt with the processor's
pixels, and tp=2 (two prompts a batch, left padded with their images), pp=2 (each micro-batch's images to the first
stage) and dp=2 give the same completions; what it does not serve is one line before any process group."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from test_vision_data import save_tiny_llava, turn

from plait.cli import main
from plait.run.prompts import completion_text
from processes import run

ROWS = [{"messages": [turn("user", None, "describe the picture")], "images": ["0.png"]},
        {"messages": [turn("user", "what colour is it")]},  # text only, beside image rows in a batch
        {"messages": [turn("user", None, None, "describe the picture")], "images": ["1.png", "2.png"], "id": 3},
        {"prompt": "a red square on"}]
FLAGS = ["--max_new_tokens", "5"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-generate")
    save_tiny_llava(root)
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    train = [{"messages": [turn("user", *[None] * (i % 2), "describe the picture"),
                           turn("assistant", "a red square on blue" if i % 3 else "blue")],
              "images": [f"{i % 3}.png"] * (i % 2)} for i in range(8)]
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    return root


def transformers_completions(root) -> list[str]:
    """transformers' greedy ``generate`` on each prompt alone, with the processor's ids and pixels."""
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(root / "model")
    model = LlavaForConditionalGeneration.from_pretrained(root / "model").eval()
    done = []
    for row in ROWS:
        if "prompt" in row:
            inputs = processor(text=[row["prompt"]], return_tensors="pt")
        else:
            text = processor.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            pictures = [Image.open(root / name) for name in row.get("images", [])] or None
            inputs = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)
        tokenizer_ = processor.tokenizer
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=tokenizer_.eos_token_id,
                             pad_token_id=tokenizer_.pad_token_id)
        done.append(completion_text(out[0, inputs["input_ids"].shape[1]:].tolist(), tokenizer_, [])[0])
    return done


def generate(root, name: str, *flags: str) -> list[dict]:
    out = root / name
    main(["generate", "--model_name_or_path", str(root / "model"), "--prompts", str(root / "prompts.jsonl"),
          "--output", str(out), *FLAGS, *flags])
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_image_prompts_complete_as_transformers_generate_and_in_every_layout(files):
    one = generate(files, "one.jsonl", "--batch_size", "1")
    assert [{k: v for k, v in row.items() if k != "completion"} for row in one] == ROWS  # rows kept, in order
    assert [row["completion"] for row in one] == transformers_completions(files)
    for name, flags in (("tp2", ["--tensor_parallel_size", "2", "--batch_size", "2"]),
                        ("pp2", ["--pipeline_parallel_size", "2", "--batch_size", "2"]),
                        ("dp2", ["--batch_size", "2"])):
        out = files / f"{name}.jsonl"
        done = run([sys.executable, "-m", "plait", "generate", "--model_name_or_path", str(files / "model"),
                    "--prompts", str(files / "prompts.jsonl"), "--output", str(out), "--nproc_per_node", "2",
                    *FLAGS, *flags], timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert [json.loads(line) for line in out.read_text().splitlines()] == one, name


@pytest.mark.parametrize("case", ["zero3-replica", "prompt-with-images", "missing-image", "tokenizer-dir"])
def test_what_image_generation_does_not_serve_is_one_line_before_any_process_group(files, tmp_path, capsys, case):
    rows = {"prompt-with-images": [{"prompt": "<image> describe", "images": ["0.png"]}],
            "missing-image": [{"messages": [turn("user", None, "describe")], "images": ["absent.png"]}]}.get(case, ROWS)
    prompts = files / f"{case}.jsonl"  # beside the pictures: relative paths are read from the file's directory
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = {"zero3-replica": ["--nproc_per_node", "2", "--zero_stage", "3", "--batch_size", "2"],
             "tokenizer-dir": ["--tokenizer_name", str(tmp_path)]}.get(case, [])  # the processor read from there
    expected = {
        "zero3-replica": "--zero_stage 3: prompts 1 to 1 of --prompts hold no image, and every replica's prompts of "
                         "a batch need one",
        "prompt-with-images": f"{prompts}:1: a prompt with images is given as 'messages' with image parts beside "
                              f"its 'images'",
        "missing-image": f"{prompts}:1: images[0] ({files / 'absent.png'}) cannot be read",
        "tokenizer-dir": f"{tmp_path}: no processor could be loaded",
    }[case]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model_name_or_path", str(files / "model"), "--prompts", str(prompts), "--output",
              str(tmp_path / "out.jsonl"), *FLAGS, *flags])
    said = capsys.readouterr().err
    assert exit_.value.code == 2 and said.count("plait: error:") == 1 and expected in said, said
    assert not (tmp_path / "out.jsonl").exists()


def test_eval_prompts_with_images_are_the_checkpoints_completions(files):
    """``plait train --eval_prompts`` on an image-text run (tp=2 with SP): at each evaluation, the completions of
    image prompts from that step's weights, as ``plait generate`` gives them from the step's checkpoint."""
    from plait.run.metrics import read_metrics

    out = files / "run"
    done = run([sys.executable, "-m", "plait", "train", "--model_name_or_path", str(files / "model"), "--train_file",
                str(files / "rows.jsonl"), "--output_dir", str(out), "--nproc_per_node", "2",
                "--tensor_parallel_size", "2", "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2",
                "--per_device_train_batch_size", "2", "--block_size", "96", "--learning_rate", "0.01",
                "--eval_prompts", str(files / "prompts.jsonl"), "--eval_max_new_tokens", "5"],
               timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    samples = next(r["samples"] for r in read_metrics(out) if r["step"] == 2 and "samples" in r)
    rows = [json.loads(line) for line in (files / "prompts.jsonl").read_text().splitlines()]
    from_checkpoint = files / "from-checkpoint.jsonl"
    main(["generate", "--model_name_or_path", str(out / "checkpoint-2"), "--prompts", str(files / "prompts.jsonl"),
          "--output", str(from_checkpoint), *FLAGS, "--batch_size", "2"])
    expected = [json.loads(line)["completion"] for line in from_checkpoint.read_text().splitlines()]
    assert [sample["completion"] for sample in samples] == expected
    assert len(samples) == len(rows) and expected != [row["completion"] for row in generate(files, "base.jsonl")]


def test_eval_prompts_whose_replica_holds_no_image_under_zero3_are_refused_at_start(files):
    """--eval_prompts under ZeRO-3 at dp=2: a batch (a prompt a replica) whose second replica holds no image is
    refused where the run starts, before any process group, as plait generate refuses it."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer

    from plait.base.config import ConfigError, ParallelConfig
    from plait.run.prompts import EvalPrompts

    args = SimpleNamespace(eval_prompts=str(files / "prompts.jsonl"), eval_max_new_tokens=5,
                           per_device_train_batch_size=1, tokenizer_name=None, model_name_or_path=str(files / "model"))
    config, tokenizer = AutoConfig.from_pretrained(files / "model"), AutoTokenizer.from_pretrained(files / "model")
    found = EvalPrompts.of_run(args, tokenizer, config, ParallelConfig(zero_stage=1, dp=2))  # ZeRO-1: served
    assert [p.example.num_images for p in found.prompts] == [1, 0, 2, 0]
    assert [p.example.pixels for p in found.prompts] == [{}] * 4  # encoded again for each batch, not kept
    with pytest.raises(ConfigError, match=r"^--zero_stage 3: prompts 1 to 1 of --eval_prompts hold no image, and "
                                          r"every replica's prompts of a batch need one"):
        EvalPrompts.of_run(args, tokenizer, config, ParallelConfig(zero_stage=3, dp=2))


def test_a_pipeline_cut_inside_deepstack_is_refused_before_any_process_group(tmp_path):
    """plait generate at pp=2 with image prompts for a Qwen3-VL whose deepstack adds visual tokens after decoder layer
    0: the default cut is refused on the meta model and the planned stages (before, inside generate, after the
    process group and the weights were read); text prompts alone are taken."""
    import argparse

    from test_vlm_train import DEEPSTACK_CUT, deepstack_config
    from transformers import AutoConfig

    from plait.base.config import ConfigError
    from plait.generate_command import check_images_served

    config = AutoConfig.from_pretrained(deepstack_config(tmp_path))
    ns = argparse.Namespace(tensor_parallel_size=1, pipeline_parallel_size=2, expert_parallel_size=1, zero_stage=0,
                            batch_size=2)
    with pytest.raises(ConfigError, match=DEEPSTACK_CUT):
        check_images_served(ns, 2, [1, 0], config)
    assert not torch.distributed.is_initialized()
    check_images_served(ns, 2, [0, 0], config)
