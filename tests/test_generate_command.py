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
        layout = {"tp2": "tp=2 pp=1 dp=1", "pp2": "tp=1 pp=2 dp=1", "dp2": "tp=1 pp=1 dp=2"}[name]
        assert f"layout {layout}): " in done.stdout, done.stdout  # generation's, not a training schedule's


def test_a_stop_string_ends_decoding_where_transformers_generate_ends_it(files, capsys):
    """``--stop``: the completions are transformers' ``generate(stop_strings=...)``'s cut before the stop string, and
    decoding stops there: the new tokens counted are transformers' (plait decoded every row on to --max_new_tokens and
    counted them all)."""
    folder, model_dir, _ = files
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    texts = [row.get("prompt") or tokenizer.apply_chat_template(row["messages"], tokenize=False,
                                                                 add_generation_prompt=True) for row in PROMPTS]
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    stop = "on"  # met early by the last prompt's greedy completion (a batch of its own), not by the first's
    met = []
    for text in (texts[0], texts[-1]):
        prompt = tokenizer([text], return_tensors="pt", add_special_tokens=False)
        free = model.generate(**prompt, **settings)[0, prompt.input_ids.shape[1]:].tolist()
        met.append(next((k for k in range(1, 13) if stop in tokenizer.decode(free[:k])), None))
    assert met[0] is None and met[1] <= 4, met
    expected, counts, widths = [], [], []
    for start in range(0, len(texts), 2):
        batch = texts[start: start + 2]
        batch += batch[-1:] * (2 - len(batch))
        encoded = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = model.generate(**encoded, **settings, stop_strings=[stop], tokenizer=tokenizer)
        new = ids[:, encoded.input_ids.shape[1]:].tolist()
        widths.append(len(new[0]))
        for row in new[: len(texts) - start]:
            expected.append(completion_text(row, tokenizer, [stop])[0])
            while row and row[-1] == tokenizer.pad_token_id:  # after its end (EOS counted) or its stop string
                row = row[:-1]
            counts.append(len(row))
    assert min(widths) < 12, widths  # a batch whose rows all met the stop string stopped early
    rows = generate(files, "stopped.jsonl", "--max_new_tokens", "12", "--batch_size", "2", "--stop", stop)
    assert [row["completion"] for row in rows] == expected
    assert f"5 completions, {sum(counts)} new tokens in " in capsys.readouterr().out, counts


def with_bos_and_ends(model_dir, target, ends_of) -> None:
    """``model_dir`` copied to ``target`` with a tokenizer that adds a BOS to a text (as Llama's, Mistral's, Gemma's
    do) and a generation config whose ``eos_token_id`` is a list (``ends_of(tokenizer)``: a chat model's end of turn
    beside its EOS)."""
    import shutil

    shutil.copytree(model_dir, target)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    bos = next(t["content"] for t in tokenizer["added_tokens"] if t["id"] == 1)
    single = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": single,
                                   "pair": [*single, {"Sequence": {"id": "B", "type_id": 1}}],
                                   "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}}}
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**settings, "bos_token": bos}))
    generation = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({
        **generation, "eos_token_id": ends_of(AutoTokenizer.from_pretrained(target))}))


def test_a_prompt_gets_its_bos_and_a_completion_ends_at_the_generation_configs_ends(files, tmp_path):
    """transformers' ``generate`` on ``tokenizer(prompt)`` (its BOS included) ending at every ``eos_token_id`` of the
    generation config: plait gave the prompt without its BOS (3 of 5 completions differed in an audit) and ended at
    the tokenizer's EOS alone (a chat model's end of turn ran on to --max_new_tokens)."""
    folder, model_dir, prompts = files
    texts = [row["prompt"] for row in PROMPTS if "prompt" in row]
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    first = AutoTokenizer.from_pretrained(model_dir)
    # an end of turn the model reaches: the second token it picks for the first prompt with a BOS
    bos_first = model.generate(torch.tensor([[1, *first(texts[0]).input_ids]]), max_new_tokens=2, do_sample=False)
    turn = int(bos_first[0, -1])
    with_bos_and_ends(model_dir, tmp_path / "bos", lambda t: [t.eos_token_id, turn])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "bos")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "bos").eval()
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, turn]
    expected = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert ids[0, 0] == 1  # the BOS
        new = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0]
        new = new[ids.shape[1]:].tolist()
        ends = [i for i, token in enumerate(new) if token in (tokenizer.eos_token_id, turn)]
        expected.append(tokenizer.decode(new[: ends[0] if ends else None], skip_special_tokens=True))  # the end cut
        if text == texts[0]:
            assert new == [*new[:1], turn]  # generate ended at the turn
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    main(["generate", "--model_name_or_path", str(tmp_path / "bos"), "--prompts", str(tmp_path / "prompts.jsonl"),
          "--output", str(out), "--max_new_tokens", "6", "--batch_size", "1"])
    assert [json.loads(line)["completion"] for line in out.read_text().splitlines()] == expected


def test_a_completion_ends_at_eos_or_before_a_stop_string(files):
    tokenizer = AutoTokenizer.from_pretrained(files[1])
    ids = tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids
    assert completion_text(ids, tokenizer, []) == ("the cat sat on the mat", len(ids))
    assert completion_text([*ids, tokenizer.eos_token_id, *ids], tokenizer, []) == ("the cat sat on the mat",
                                                                                   len(ids) + 1)
    sat = next(k for k in range(1, len(ids) + 1) if "sat" in tokenizer.decode(ids[:k]))
    assert sat < len(ids)
    assert completion_text(ids, tokenizer, ["on", "sat"]) == ("the cat ", sat)  # counted to where decoding stopped


@pytest.mark.parametrize("case", ["not-json", "no-prompt", "batch-vs-dp", "no-model", "top-p", "split", "greedy-top-k",
                                  "greedy-top-k-p", "images", "image-part", "room"])
def test_bad_input_is_one_line_before_anything_loads(files, tmp_path, capsys, case):
    folder, model_dir, prompts = files
    bad = tmp_path / "bad.jsonl"
    second = {"not-json": "{oops", "images": json.dumps({"prompt": "<image> a cat", "images": ["cat.png"]}),
              "image-part": json.dumps({"messages": [{"role": "user", "content": [{"type": "image"},
                                                                               {"type": "text", "text": "a cat"}]}]}),
              "room": json.dumps({"prompt": "the cat sat on the mat " * 8})}.get(case, '{"text": "x"}')
    bad.write_text('{"prompt": "ok"}\n' + second + "\n")
    flags = {"not-json": ["--prompts", str(bad)], "no-prompt": ["--prompts", str(bad)],
             "batch-vs-dp": ["--nproc_per_node", "2", "--batch_size", "3"],
             "no-model": ["--model_name_or_path", str(tmp_path / "missing")], "top-p": ["--top_p", "0"],
             "split": ["--nproc_per_node", "2", "--tensor_parallel_size", "2", "--pipeline_parallel_size", "2"],
             "greedy-top-k": ["--top_k", "5"], "greedy-top-k-p": ["--top_k", "5", "--top_p", "0.9"],
             "images": ["--prompts", str(bad)], "image-part": ["--prompts", str(bad)],
             "room": ["--prompts", str(bad), "--max_new_tokens", "40"]}[case]
    expected = {"not-json": f"{bad}:2: not JSON", "no-prompt": f"{bad}:2: a line needs a non-empty 'prompt'",
                "batch-vs-dp": "--batch_size 3 is split over dp=2 replicas: give a multiple of 2 (2, 4, 6, ...)",
                "no-model": "is neither a model directory", "top-p": "0 < top_p <= 1",
                "split": "--tensor_parallel_size 2 x --pipeline_parallel_size 2 does not divide 2 processes",
                "greedy-top-k": "--top_k 5 shapes sampling, and --temperature 0 decodes greedily; give --temperature "
                                "> 0 (e.g. 1.0) to sample, or drop it",
                "greedy-top-k-p": "--top_k 5 --top_p 0.9 shape sampling, and --temperature 0 decodes greedily",
                "images": f"{bad}:2: the row has images, but --prompts completes text prompts only (the images would "
                          f"not reach the model); give its text alone",
                "image-part": f"{bad}:2: the row has images",
                "room": f"{bad}:2: the prompt's 49 tokens and --max_new_tokens 40 need 89 positions, more than the "
                        f"model's max_position_embeddings=64; give --max_new_tokens 15 or less"}[case]
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
