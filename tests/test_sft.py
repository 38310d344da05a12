"""SFT data on one process: format detection, bad lines, label masks, padding and packing, the cache, the
block-diagonal mask transformers builds from packed position ids, and a short `plait train` run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.base.config import ConfigError
from plait.data.chat_tokenizer import chat_tokenizer, save_chat_tokenizer
from plait.data.sft import SFTCache, SFTEncoder, data_format, load_sft_data, read_records
from plait.data.sft_blocks import (
    Example, batch_inputs, count_labels, describe_counts, lay_out, truncation_warning,
)
from plait.data.sources import resolve_sources
from plait.run.train_args import TrainArgs

from tiny_models import tiny_model

WORDS = ["what is two plus two", "four", "name a colour", "blue", "hello there", "hi, how can I help"]
CHATS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"},
                  {"role": "assistant", "content": "four"}, {"role": "user", "content": "name a colour"},
                  {"role": "assistant", "content": "blue"}]},
    {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help"}]},
]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(WORDS * 20, 300)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_chat_tokenizer(WORDS * 20, 300, tmp_path_factory.mktemp("tok") / "tokenizer")


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_chat_labels_are_the_assistant_turns(tokenizer):
    ids, trainable = SFTEncoder(tokenizer, "chat", False).encode(CHATS[0], "x")
    assert tokenizer.decode(ids[trainable]) == "four<|im_end|>\nblue<|im_end|>\n"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHATS[0]["messages"], tokenize=False)
    _, everything = SFTEncoder(tokenizer, "chat", True).encode(CHATS[0], "x")
    assert everything.all()


def test_prompt_completion_labels(tokenizer):
    ids, trainable = SFTEncoder(tokenizer, "prompt_completion", False).encode(
        {"prompt": "name a colour", "completion": " blue"}, "x")
    assert tokenizer.decode(ids[~trainable]) == "name a colour"
    assert tokenizer.decode(ids[trainable]) == " blue<|im_end|>"  # ends in eos: generation learns to stop


def test_a_tokenizer_without_chat_template_is_refused(tokenizer):
    plain = chat_tokenizer(WORDS, 300)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        SFTEncoder(plain, "chat", False)


def test_format_detection(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello"}])
    assert data_format(TrainArgs(train_file=str(chat)).sft_source()) == "chat"
    assert data_format(TrainArgs(train_file=str(pc)).sft_source()) == "prompt_completion"
    assert data_format(TrainArgs(train_file=str(text)).sft_source()) == "text"
    assert data_format(TrainArgs().sft_source()) == "text"
    assert data_format(TrainArgs(train_file=str(text), data_format="chat").sft_source()) == "chat"


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a"}', "no 'completion' \\(found 'prompt'\\)"),
    ('{"prompt": "a", "completion": 3}', r"completion is int \(3\), expected a string"),
    ('{"prompt": "a", "completions": "b"}', "no 'completion' .*did you mean 'completion' for 'completions'"),
    ("[1, 2]", "not a JSON object"),
    ("{oops", "not valid JSON"),
])
def test_bad_line_names_file_and_line(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, "", line])
    with pytest.raises(ValueError, match=rf"d.jsonl line 3: {problem}"):
        list(read_records(path, "prompt_completion"))


def _chat(*turns, key="messages"):
    return {key: list(turns)}


USER, ASSISTANT = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("record, problem", [
    (_chat(USER), r"no assistant message in messages \(roles: user\)"),
    (_chat(USER, {"role": "assistant", "content": 4}), r"messages\[1\]\.content is int \(4\), expected a string"),
    (_chat({"role": "user", "text": "hi"}, ASSISTANT), r"messages\[0\] has no 'content' \(found 'role', 'text'\)"),
    (_chat({"role": "bot", "content": "hi"}, ASSISTANT),
     r"messages\[0\]\.role is 'bot'; expected one of system, developer, user, assistant, tool"),
    (_chat({"role": None, "content": "hi"}, ASSISTANT), r"messages\[0\]\.role is null, expected a string"),
    (_chat("hi", ASSISTANT), r"messages\[0\] is str \(\"hi\"\), expected an object with 'role' and 'content'"),
    ({"messages": {"role": "user", "content": "hi"}}, r"messages is dict \(.*\), expected a non-empty list"),
    ({"messages": []}, r"messages is list \(\[\]\), expected a non-empty list"),
    ({"message": [USER, ASSISTANT]}, r"no 'messages' or 'conversations' list \(found 'message'; did you mean "
                                     r"'messages'\?\)"),
    (_chat({"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}, key="conversations"),
     r"conversations\[1\]\.from is 'robot', not a ShareGPT role; expected one of human, user, gpt"),
    (_chat({"from": "human", "value": "hi"}, {"from": "gpt", "value": 7}, key="conversations"),
     r"conversations\[1\]\.value is int \(7\), expected a string"),
    (_chat({"from": "human", "value": "hi"}, {"from": "gpt", "text": "x"}, key="conversations"),
     r"conversations\[1\] has no 'value' \(found 'from', 'text'\)"),
])
def test_bad_chat_lines_name_the_field(tmp_path, record, problem):
    path = write_jsonl(tmp_path / "c.jsonl", [CHATS[0], "", record])
    with pytest.raises(ValueError, match=f"c.jsonl line 3: {problem}"):
        list(read_records(path, "chat"))


@pytest.mark.parametrize("first, message", [
    ({"message": CHATS[0]["messages"]}, "found 'message' \\(did you mean 'messages'\\?\\)"),
    ({"id": 1, "Conversation": []}, "found 'id', 'Conversation' \\(did you mean 'conversations' for "
                                    "'Conversation'\\?\\)"),
    ({"prompt": "a", "completions": "b"}, "found 'prompt', 'completions' \\(did you mean 'completion' for "
                                          "'completions'\\?\\)"),
    ({"prompt": "a", "answer": "b"}, "found 'prompt', 'answer'; prompt/completion data needs both 'prompt' and "
                                     "'completion'"),
    ({"body": "plain"}, "found 'body'; name the text field with --text_field"),
])
def test_unknown_first_line_names_its_near_misses(tmp_path, first, message):
    path = write_jsonl(tmp_path / "data.jsonl", [first, CHATS[1]])
    with pytest.raises(ConfigError, match=r"data.jsonl line 1: no 'messages', 'conversations', 'prompt'\+'completion' "
                                          rf"or 'text' field; {message}"):
        data_format(TrainArgs(train_file=str(path)).sft_source())


def test_plain_text_jsonl_and_txt_stay_text(tmp_path):
    body = write_jsonl(tmp_path / "body.jsonl", [{"body": "plain", "id": 1}])
    assert data_format(TrainArgs(train_file=str(body), text_field="body").sft_source()) == "text"
    txt = tmp_path / "notes.txt"
    txt.write_text('{"message": "a .txt file is text whatever it holds"}\n')
    assert data_format(TrainArgs(train_file=str(txt)).sft_source()) == "text"


SHAREGPT_ROLE_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}


def test_sharegpt_is_chat_with_the_tokens_of_its_messages(tmp_path, tokenizer):
    """ShareGPT conversations are detected as chat and cached as exactly the ids and labels of the same
    conversations written as messages."""
    sharegpt = [{"conversations": [{"from": SHAREGPT_ROLE_NAMES[m["role"]], "value": m["content"]}
                                   for m in chat["messages"]]} for chat in CHATS]
    sharegpt[1]["conversations"][1]["from"] = "chatgpt"  # ShareGPT V3 names the model that answered
    shared = write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt)
    assert data_format(TrainArgs(train_file=str(shared)).sft_source()) == "chat"
    assert [r for _, r in read_records(shared, "chat")] == CHATS
    encoder = SFTEncoder(tokenizer, "chat", False)
    caches = [SFTCache(tmp_path / "cache", resolve_sources(path), encoder)
              for path in (write_jsonl(tmp_path / "messages.jsonl", CHATS), shared)]
    examples = []
    for cache in caches:
        cache.ensure(0, 10.0)
        examples.append(cache.examples())
    assert caches[0].path != caches[1].path  # each file its own entry
    for plain, converted in zip(*examples):
        assert converted.ids.tolist() == plain.ids.tolist()
        assert converted.trainable.tolist() == plain.trainable.tolist() and converted.trainable.any()


def _examples(lengths, trainable_from=1):
    return [Example(np.arange(1, n + 1), np.arange(n) >= trainable_from, f"line {i + 1}") for i, n in enumerate(lengths)]


def test_padding_masks_pad_and_first_tokens():
    blocks = lay_out(_examples([3, 5]), 6, pad_id=0, packing=False, overlong="truncate")
    assert blocks.position_ids is None
    assert blocks.input_ids.tolist() == [[1, 2, 3, 0, 0, 0], [1, 2, 3, 4, 5, 0]]
    assert blocks.labels.tolist() == [[-100, 2, 3, -100, -100, -100], [-100, 2, 3, 4, 5, -100]]
    assert (blocks.real_tokens, blocks.pad_tokens) == (8, 4)
    assert count_labels(blocks, torch.arange(2)) == 6


def test_packing_restarts_positions_per_example():
    blocks = lay_out(_examples([5, 3, 2, 4], trainable_from=0), 8, pad_id=0, packing=True, overlong="truncate")
    # best fit, longest first: [5 + 3], [4 + 2 + padding]
    assert blocks.input_ids.tolist() == [[1, 2, 3, 4, 5, 1, 2, 3], [1, 2, 3, 4, 1, 2, 0, 0]]
    assert blocks.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 1]]
    # no token is predicted across an example boundary: every example's first label is masked
    assert blocks.labels.tolist() == [[-100, 2, 3, 4, 5, -100, 2, 3], [-100, 2, 3, 4, -100, 2, -100, -100]]
    ids, labels, positions = batch_inputs(blocks, torch.tensor([1]), torch.device("cpu"))
    assert ids.dtype == labels.dtype == positions.dtype == torch.int64
    assert (len(blocks), blocks.pad_tokens, blocks.num_examples) == (2, 2, 4)


def test_overlong_truncated_or_refused():
    blocks = lay_out(_examples([9]), 4, pad_id=0, packing=True, overlong="truncate")
    assert blocks.input_ids.tolist() == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"line 2: the example has 9 tokens, more than --block_size=4"):
        lay_out(_examples([2, 9]), 4, pad_id=0, packing=False, overlong="refuse")


def test_counts_are_those_after_truncation():
    """--block_size 6 over examples of 3 tokens (2 trainable), 9 (5 trainable from position 4: 2 survive) and
    9 (2 trainable from position 7: none survive): what is printed counts what the blocks really hold."""
    examples = [Example(np.arange(1, n + 1), np.arange(n) >= start, f"line {i + 1}")
                for i, (n, start) in enumerate([(3, 1), (9, 4), (9, 7)])]
    blocks = lay_out(examples, 6, pad_id=0, packing=False, overlong="truncate")
    c = blocks.counts
    # example 1: 2 labels kept; example 2: 5 trainable, 2 kept (positions 4, 5); example 3: 2 trainable, none kept
    assert (c.examples, c.kept, c.truncated, c.dropped, c.untrainable) == (3, 3, 2, 0, 1)
    assert (c.trainable_kept, c.trainable_lost, c.longest) == (4, 5, 9)
    assert count_labels(blocks, torch.arange(len(blocks))) == c.trainable_kept
    line = describe_counts(c, 6)
    assert line == ("3 of 3 examples kept, 2 truncated to --block_size=6, 1 with no token left to train on; "
                    "4 tokens trained on, 5 (56%) lost to truncation")
    warning = truncation_warning(c, 6)
    assert "loses 56% of the tokens to train on (5 of 9)" in warning and "longest example has 9 tokens" in warning
    assert "--overlong drop" in warning

    dropped = lay_out(examples, 6, pad_id=0, packing=False, overlong="drop")
    c = dropped.counts
    assert (c.kept, c.dropped, c.untrainable, c.trainable_kept, c.trainable_lost) == (2, 1, 0, 4, 5)
    assert len(dropped) == 2 and "1 dropped" in describe_counts(c, 6)
    assert truncation_warning(lay_out(examples, 9, 0, False, "truncate").counts, 9) is None


def test_nothing_left_to_train_on_is_refused():
    examples = [Example(np.arange(1, 10), np.arange(9) >= 7, "line 1")]
    with pytest.raises(ValueError, match=r"no SFT example is left to train on \(of 1, --overlong drop dropped 1\)"):
        lay_out(examples, 6, pad_id=0, packing=False, overlong="drop")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_attend_within_each_example(arch, attn):
    """transformers builds a block-diagonal causal mask from restarting position ids: each packed example's
    logits equal the example run alone."""
    model = tiny_model(arch, attn_implementation=attn).eval()
    model.config._attn_implementation = attn
    blocks = lay_out(_examples([7, 5, 4, 3, 6, 2]), 12, pad_id=0, packing=True, overlong="truncate")
    ids, _, positions = batch_inputs(blocks, torch.arange(len(blocks)), torch.device("cpu"))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        unmasked = model(input_ids=ids, use_cache=False).logits
        for row in range(len(blocks)):
            starts = (positions[row] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
            for a, b in zip(starts[:-1], starts[1:]):
                alone = model(input_ids=ids[row:row + 1, a:b], use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, a:b], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed, unmasked, atol=1e-4)  # the mask is really there


def test_cache_reuses_entries_and_keys_masking(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    sources = resolve_sources(path)
    first = SFTCache(tmp_path / "cache", sources, SFTEncoder(tokenizer, "chat", False))
    assert first.ensure(0, 10.0)[1] is True
    again = SFTCache(tmp_path / "cache", sources, SFTEncoder(tokenizer, "chat", False))
    meta, made = again.ensure(0, 10.0)
    assert made is False and meta["num_documents"] == 2
    other = SFTCache(tmp_path / "cache", sources, SFTEncoder(tokenizer, "chat", True))
    assert other.path != first.path
    examples = again.examples()
    assert [e.where for e in examples] == [f"{path} line 1", f"{path} line 2"]
    ids, trainable = SFTEncoder(tokenizer, "chat", False).encode(CHATS[1], "x")
    assert examples[1].ids.tolist() == ids.tolist() and examples[1].trainable.tolist() == trainable.tolist()
    assert not list((tmp_path / "cache" / "sft").glob(".*tmp*"))


def test_load_sft_data_errors_before_any_process_group(tmp_path, tokenizer_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", [CHATS[0], {"prompt": "x", "completion": "y"}])
    args = TrainArgs(train_file=str(bad), tokenizer_name=str(tokenizer_dir), data_cache_dir=str(tmp_path / "c"),
                     block_size=64)
    with pytest.raises(ConfigError, match="bad.jsonl line 2: no 'messages' or 'conversations' list"):
        load_sft_data(args.sft_source(), 300)
    good = write_jsonl(tmp_path / "good.jsonl", CHATS)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_sft_data(TrainArgs(train_file=str(good), data_cache_dir=str(tmp_path / "c")).sft_source(), 300)
    with pytest.raises(ConfigError, match="more than --block_size=8"):
        load_sft_data(TrainArgs(train_file=str(good), tokenizer_name=str(tokenizer_dir), block_size=8,
                                overlong="refuse", data_cache_dir=str(tmp_path / "c")).sft_source(), 300)


def test_plait_train_on_chat_data(tmp_path, tokenizer_dir):
    from plait.run.trainer import train

    data = write_jsonl(tmp_path / "chat.jsonl", CHATS * 8)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 64}))
    history = train(TrainArgs(model_config=str(config), train_file=str(data), validation_file=str(data),
                              tokenizer_name=str(tokenizer_dir), block_size=64, packing=True, max_steps=3,
                              per_device_train_batch_size=2, output_dir=str(tmp_path / "run"), device="cpu",
                              data_cache_dir=str(tmp_path / "cache"), learning_rate=1e-2))
    assert len(history) == 3 and all(np.isfinite(r["loss"]) for r in history)
    assert history[-1]["loss"] < history[0]["loss"] and "eval_loss" in history[-1]


def test_prepare_data_fills_the_sft_cache(tmp_path, tokenizer_dir, capsys):
    from plait.cli import main

    data = write_jsonl(tmp_path / "chat.jsonl", CHATS * 4)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}))
    flags = ["--model_config", str(config), "--train_file", str(data), "--tokenizer_name", str(tokenizer_dir),
             "--block_size", "64", "--packing", "--max_steps", "4", "--data_cache_dir", str(tmp_path / "cache")]
    main(["prepare-data", *flags])
    out = capsys.readouterr()
    assert "train data (chat): 8 of 8 examples kept" in out.err and "tokenized into" in out.err
    assert "--max_steps 4: 32 blocks" in out.out
    main(["prepare-data", *flags])
    assert "read from" in capsys.readouterr().err  # the run that follows only reads the entry
