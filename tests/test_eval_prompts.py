"""``plait train --eval_prompts``: completions at each evaluation from the training layout's own shards (tp=2 with
sequence parallelism here), the same as one process completing the prompts from the checkpoint of that step; and the
refusals, in one line before anything runs. The trackers' tables of the samples: tests/test_trackers.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from plait.base.config import ConfigError, ParallelConfig
from plait.checkpoint.materialize import load_parallel_model
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run.metrics import read_metrics
from plait.run.prompts import complete, encode_prompts, render
from plait.run.train_args import TrainArgs
from processes import run as run_command
from tiny_models import tiny_config

TEXT = "the cat sat on the mat. a dog ran in the park. birds sing in the morning light."
PROMPTS = [{"prompt": "the cat"}, {"messages": [{"role": "user", "content": "a dog"}]}, {"prompt": "birds sing in"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-prompts")
    (out / "config.json").write_text(tiny_config("llama", vocab_size=320).to_json_string())
    (out / "train.txt").write_text((TEXT + "\n") * 200)
    save_chat_tokenizer([TEXT] * 20, 300, out / "tokenizer")
    (out / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    done = run_command([sys.executable, "-m", "plait", "train", "--model_config", str(out / "config.json"),
                        "--train_file", str(out / "train.txt"),
            "--tokenizer_name", str(out / "tokenizer"), "--output_dir", str(out / "run"), "--nproc_per_node", "2",
            "--tensor_parallel_size", "2", "--max_steps", "4", "--eval_steps", "2", "--save_steps", "2",
            "--per_device_train_batch_size", "2", "--block_size", "16", "--learning_rate", "0.03",
            "--eval_prompts", str(out / "prompts.jsonl"), "--eval_max_new_tokens", "6"],
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_samples_are_one_process_completions_from_the_steps_weights(run):
    records = {r["step"]: r for r in read_metrics(run / "run")}
    assert [step for step, r in records.items() if "samples" in r] == [2, 4]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run / "tokenizer")
    texts = [render(row, tokenizer) for row in PROMPTS]
    ids = [prompt.ids for prompt in encode_prompts(list(enumerate(PROMPTS, start=1)), tokenizer)]
    for step in (2, 4):
        pmodel = load_parallel_model(run / "run" / f"checkpoint-{step}", ParallelConfig(), dtype=torch.float32,
                                     device=torch.device("cpu"))
        # the same batches of prompts as the run's (its training batch per replica: 2, over dp=1)
        expected = complete(pmodel, tokenizer, ids, batch_size=2, device=torch.device("cpu"), max_new_tokens=6)
        assert records[step]["samples"] == [{"prompt": text, "completion": completion}
                                            for text, (completion, _) in zip(texts, expected)], step
    assert records[2]["samples"] != records[4]["samples"]  # taken from each step's weights, not the first's


@pytest.mark.parametrize("flags, message", [
    (dict(eval_prompts="missing.jsonl"), r"^--eval_prompts missing.jsonl: no such file$"),
    (dict(eval_prompts="PROMPTS", eval_max_new_tokens=0), r"^--eval_max_new_tokens=0 must be positive$"),
    (dict(eval_max_new_tokens=8), r"^--eval_max_new_tokens=8 has no effect without --eval_prompts; drop it, or give "
                                  r"--eval_prompts FILE.jsonl$"),
    (dict(eval_prompts="BAD"), r"bad.jsonl:2: a line needs a non-empty 'prompt' string or a 'messages' list$"),
])
def test_bad_eval_prompts_are_refused_in_one_line(tmp_path, flags, message):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    files = {"PROMPTS": str(tmp_path / "prompts.jsonl"), "BAD": str(tmp_path / "bad.jsonl")}
    flags = {k: files.get(v, v) if isinstance(v, str) else v for k, v in flags.items()}
    args = TrainArgs(**flags)
    with pytest.raises(ConfigError, match=message):
        args.validate()
        args.check_flags_take_effect()


def test_a_run_without_a_tokenizer_is_told_to_give_one(tmp_path):
    from plait.run.prompts import EvalPrompts

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match=r"the run has no tokenizer to write and read prompts with; give "
                                          r"--tokenizer_name$"):
        EvalPrompts(tmp_path / "prompts.jsonl", None, 8, 2, None)


def test_image_prompts_for_a_text_model_are_refused_where_the_model_is_known(tmp_path):
    """--eval_prompts' file is read for its form when the flags are checked (images allowed: an image-text run's
    prompts may hold them) and refused for a text model's run once the model is known, before any process group."""
    from plait.run.prompts import EvalPrompts

    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}],
           "images": ["x.png"]}
    (tmp_path / "prompts.jsonl").write_text(json.dumps(row) + "\n")
    TrainArgs(eval_prompts=str(tmp_path / "prompts.jsonl")).validate()
    with pytest.raises(ConfigError, match=r"prompts.jsonl:1: the row has images, but --eval_prompts completes text "
                                          r"prompts only"):
        EvalPrompts(tmp_path / "prompts.jsonl", object(), 8, 2, None)
