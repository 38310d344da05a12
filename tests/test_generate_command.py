"""``plait generate`` (plait.generate_command): a file of prompts completed from a model's shards, from a Hugging Face
dir or a plait checkpoint, equal to transformers' ``generate`` on one process (greedy) and the same in every layout
(sampled); bad input in one line before anything loads. The decoding itself is held to one process in every layout
generation serves by tests/test_generate.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from plait.cli import main
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run.prompts import completion_text
from processes import run

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "birds sing in the morning light", "rain falls softly"]
PROMPTS = [{"prompt": "the cat"}, {"prompt": "a dog ran", "id": 7}, {"messages": [{"role": "user", "content": "sing"}]},
           {"prompt": "rain"}, {"prompt": "birds sing in the"}]
GREEDY = ["--max_new_tokens", "6", "--batch_size", "2"]
SAMPLED = [*GREEDY, "--temperature", "1.0", "--top_k", "20", "--seed", "3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generate")
    model_dir = folder / "model"
    save_chat_tokenizer(TEXTS * 20, 300, model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return folder, model_dir, prompts


def generate(files, out_name: str, *flags: str, source=None) -> list[dict]:
    folder, model_dir, prompts = files
    out = folder / out_name
    main(["generate", "--model_name_or_path", str(source or model_dir), "--prompts", str(prompts), "--output", str(out),
          *flags])
    return [json.loads(line) for line in out.read_text().splitlines()]


def transformers_greedy(model_dir) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    texts = [row.get("prompt") or tokenizer.apply_chat_template(row["messages"], tokenize=False,
                                                                 add_generation_prompt=True) for row in PROMPTS]
    done = []
    for first in range(0, len(texts), 2):
        batch = texts[first: first + 2]
        batch += batch[-1:] * (2 - len(batch))
        encoded = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = model.generate(**encoded, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        done += [completion_text(row, tokenizer, [])[0] for row in ids[:, encoded.input_ids.shape[1]:].tolist()]
    return done[: len(texts)]


def test_one_process_equals_transformers_generate_and_a_checkpoint_the_model_dir(files, capsys):
    folder, model_dir, _ = files
    rows = generate(files, "one.jsonl", *GREEDY)
    assert [{k: v for k, v in row.items() if k != "completion"} for row in rows] == PROMPTS  # rows kept, in order
    assert [row["completion"] for row in rows] == transformers_greedy(model_dir)
    said = capsys.readouterr().out
    assert "5 completions" in said and "tokens/s" in said, said
    # a plait checkpoint of the same weights (its tokenizer saved beside them): the same completions
    from plait import ParallelConfig, parallelize
    from plait.checkpoint import save_checkpoint

    pmodel = parallelize(LlamaForCausalLM.from_pretrained(model_dir), ParallelConfig())
    save_checkpoint(folder / "checkpoint", pmodel, step=1, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    assert generate(files, "from-checkpoint.jsonl", *GREEDY, source=folder / "checkpoint") == rows


def test_every_layout_gives_one_process_completions(files):
    """A real command per layout (forked workers): greedy at tp=2 and at pp=2, sampled at dp=2 over the same global
    batches."""
    folder, model_dir, prompts = files
    greedy, sampled = generate(files, "greedy.jsonl", *GREEDY), generate(files, "sampled.jsonl", *SAMPLED)
    assert sampled != greedy
    for name, flags, expected in (("tp2", [*GREEDY, "--tensor_parallel_size", "2"], greedy),
                                  ("pp2", [*GREEDY, "--pipeline_parallel_size", "2"], greedy),
                                  ("dp2", SAMPLED, sampled)):
        out = folder / f"{name}.jsonl"
        done = run([sys.executable, "-m", "plait", "generate", "--model_name_or_path", str(model_dir), "--prompts",
                    str(prompts), "--output", str(out), "--nproc_per_node", "2", *flags], timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert [json.loads(line) for line in out.read_text().splitlines()] == expected, name
        assert done.stdout.count("5 completions") == 1, done.stdout


def test_a_completion_ends_at_eos_or_before_a_stop_string(files):
    tokenizer = AutoTokenizer.from_pretrained(files[1])
    ids = tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids
    assert completion_text(ids, tokenizer, []) == ("the cat sat on the mat", len(ids))
    assert completion_text([*ids, tokenizer.eos_token_id, *ids], tokenizer, []) == ("the cat sat on the mat",
                                                                                   len(ids) + 1)
    assert completion_text(ids, tokenizer, ["on", "sat"]) == ("the cat ", len(ids))


@pytest.mark.parametrize("case", ["not-json", "no-prompt", "batch-vs-dp", "no-model", "top-p", "split", "greedy-top-k",
                                  "greedy-top-k-p"])
def test_bad_input_is_one_line_before_anything_loads(files, tmp_path, capsys, case):
    folder, model_dir, prompts = files
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n' + ("{oops\n" if case == "not-json" else '{"text": "x"}\n'))
    flags = {"not-json": ["--prompts", str(bad)], "no-prompt": ["--prompts", str(bad)],
             "batch-vs-dp": ["--nproc_per_node", "2", "--batch_size", "3"],
             "no-model": ["--model_name_or_path", str(tmp_path / "missing")], "top-p": ["--top_p", "0"],
             "split": ["--nproc_per_node", "2", "--tensor_parallel_size", "2", "--pipeline_parallel_size", "2"],
             "greedy-top-k": ["--top_k", "5"], "greedy-top-k-p": ["--top_k", "5", "--top_p", "0.9"]}[case]
    expected = {"not-json": f"{bad}:2: not JSON", "no-prompt": f"{bad}:2: a line needs a non-empty 'prompt'",
                "batch-vs-dp": "--batch_size 3 is split over dp=2 replicas: give a multiple of 2 (2, 4, 6, ...)",
                "no-model": "is neither a model directory", "top-p": "0 < top_p <= 1",
                "split": "--tensor_parallel_size 2 x --pipeline_parallel_size 2 does not divide 2 processes",
                "greedy-top-k": "--top_k 5 shapes sampling, and --temperature 0 decodes greedily; give --temperature "
                                "> 0 (e.g. 1.0) to sample, or drop it",
                "greedy-top-k-p": "--top_k 5 --top_p 0.9 shape sampling, and --temperature 0 decodes greedily"}[case]
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model_name_or_path", str(model_dir), "--prompts", str(prompts), "--output", str(out),
              *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("plait: error:") == 1 and expected in err, err
    assert not out.exists()


def test_the_command_is_listed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "generate" in capsys.readouterr().out
