"""Tests for plait.data: corpus, tokenizer, packing and sampling (CPU only, no network)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import plait.data.tokenizer as tokenizer_module
from plait.data import (
    GlobalBatchSampler,
    default_corpus_path,
    load_or_train_tokenizer,
    local_microbatch,
    pack_blocks,
    tokenize_files,
    train_bpe_tokenizer,
)

SAMPLE_TEXT = "Hello, wörld!\n\n  Tabs\tand émoji 🙂 <odd> bytes\r\n"


@pytest.fixture(scope="module")
def corpus_slice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first ~150 KB of the bundled corpus: enough for BPE, fast to train on."""
    path = tmp_path_factory.mktemp("corpus") / "slice.txt"
    path.write_text(default_corpus_path().read_text(encoding="utf-8")[:150_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small_tokenizer(corpus_slice: Path):
    return train_bpe_tokenizer([corpus_slice], 512)


def test_default_corpus_is_bundled_real_text() -> None:
    path = default_corpus_path()
    size = path.stat().st_size
    assert 500_000 < size < 5_000_000
    assert "To be, or not to be" in path.read_text(encoding="utf-8")
    assert (path.parent / "SOURCE.md").is_file()


@pytest.mark.parametrize("vocab_size", [257, 300, 512, 2000])
def test_tokenizer_fits_vocab_size(corpus_slice: Path, vocab_size: int) -> None:
    tokenizer = train_bpe_tokenizer([corpus_slice], vocab_size)
    assert len(tokenizer) <= vocab_size
    assert tokenizer.decode(tokenizer(SAMPLE_TEXT)["input_ids"]) == SAMPLE_TEXT


def test_tokenizer_on_full_corpus() -> None:
    tokenizer = train_bpe_tokenizer([default_corpus_path()], 2000)
    assert len(tokenizer) == 2000
    ids = tokenizer("To be, or not to be: that is the question")["input_ids"]
    assert len(ids) < 15  # common words are merged, not spelled out byte by byte


def test_tokenizer_too_small_vocab(corpus_slice: Path) -> None:
    with pytest.raises(ValueError, match=r"vocab_size=100 .*minimum is 257"):
        train_bpe_tokenizer([corpus_slice], 100)


def test_tokenizer_special_token(small_tokenizer) -> None:
    eos = small_tokenizer.eos_token_id
    assert small_tokenizer.eos_token == "<|endoftext|>"
    assert small_tokenizer.bos_token_id == eos
    assert small_tokenizer.pad_token_id == eos
    assert eos < len(small_tokenizer)


def test_tokenizer_round_trip_through_save_pretrained(small_tokenizer, tmp_path: Path) -> None:
    small_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = small_tokenizer(SAMPLE_TEXT)["input_ids"]
    assert loaded(SAMPLE_TEXT)["input_ids"] == ids
    assert loaded.decode(ids) == SAMPLE_TEXT
    assert len(loaded) == len(small_tokenizer)
    assert loaded.eos_token_id == small_tokenizer.eos_token_id


def test_tokenizer_is_deterministic(corpus_slice: Path, small_tokenizer) -> None:
    again = train_bpe_tokenizer([corpus_slice], 512)
    assert again.backend_tokenizer.to_str() == small_tokenizer.backend_tokenizer.to_str()


def test_load_or_train_caches(corpus_slice: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_or_train_tokenizer(None, [corpus_slice], 300, tmp_path)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp")

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", no_training)
    second = load_or_train_tokenizer(None, [corpus_slice], 300, tmp_path)
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    with pytest.raises(AssertionError):  # another vocab_size is another cache entry
        load_or_train_tokenizer(None, [corpus_slice], 301, tmp_path)
    assert list(tmp_path.iterdir()) == entries  # nothing half-written left behind


def test_load_or_train_uses_given_dir(small_tokenizer, corpus_slice: Path, tmp_path: Path) -> None:
    small_tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_or_train_tokenizer(tmp_path / "tok", [corpus_slice], 512, tmp_path / "cache")
    assert len(loaded) == len(small_tokenizer)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match=r"512 tokens.*vocab_size=400"):
        load_or_train_tokenizer(tmp_path / "tok", [corpus_slice], 400, tmp_path / "cache")


def test_tokenize_txt_and_jsonl(small_tokenizer, tmp_path: Path) -> None:
    eos = small_tokenizer.eos_token_id
    txt = tmp_path / "a.txt"
    txt.write_text("First line.\n\nSecond paragraph.\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 7}) + "\n", encoding="utf-8")

    ids = tokenize_files([txt, jsonl], small_tokenizer)
    assert ids.dtype == torch.long and ids.dim() == 1

    def encode(text: str) -> list[int]:
        return small_tokenizer(text, add_special_tokens=False)["input_ids"]

    expected = encode(txt.read_text(encoding="utf-8")) + [eos] + encode("one") + [eos] + encode("two") + [eos]
    assert ids.tolist() == expected


def test_tokenize_bad_jsonl(small_tokenizer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        tokenize_files([bad], small_tokenizer)


def test_tokenize_empty_files(small_tokenizer, tmp_path: Path) -> None:
    empty_txt = tmp_path / "empty.txt"
    empty_txt.write_text("", encoding="utf-8")
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n" + json.dumps({"text": ""}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty.txt.*empty.jsonl"):
        tokenize_files([empty_txt, empty_jsonl], small_tokenizer)


def test_pack_blocks() -> None:
    ids = torch.arange(103)
    blocks = pack_blocks(ids, 10)
    assert blocks.shape == (10, 10)
    assert blocks[3].tolist() == list(range(30, 40))
    assert pack_blocks(ids, 103).shape == (1, 103)
    with pytest.raises(ValueError, match=r"103 tokens.*block_size=104"):
        pack_blocks(ids, 104)


def test_sampler_is_a_function_of_seed_and_step() -> None:
    a = GlobalBatchSampler(num_blocks=50, global_batch_size=8, seed=3)
    b = GlobalBatchSampler(num_blocks=50, global_batch_size=8, seed=3)
    other = GlobalBatchSampler(num_blocks=50, global_batch_size=8, seed=4)
    for step in (0, 1, 7, 123):
        assert torch.equal(a.indices(step), b.indices(step))
        assert a.indices(step).shape == (8,)
    assert not all(torch.equal(a.indices(s), other.indices(s)) for s in range(5))


@pytest.mark.parametrize("num_blocks,global_batch_size", [(40, 8), (37, 8), (5, 12)])
def test_sampler_sees_every_block_once_per_epoch(num_blocks: int, global_batch_size: int) -> None:
    sampler = GlobalBatchSampler(num_blocks, global_batch_size, seed=0)
    epochs = 3
    steps = -(-epochs * num_blocks // global_batch_size)
    stream = torch.cat([sampler.indices(s) for s in range(steps)])
    for epoch in range(epochs):
        seen = stream[epoch * num_blocks : (epoch + 1) * num_blocks]
        assert sorted(seen.tolist()) == list(range(num_blocks))


def test_sampler_jump_equals_sequential_and_resume() -> None:
    sequential = GlobalBatchSampler(num_blocks=37, global_batch_size=8, seed=11)
    history = [sequential.indices(s) for s in range(30)]
    jumper = GlobalBatchSampler(num_blocks=37, global_batch_size=8, seed=11)
    for step in (29, 0, 17, 4):
        assert torch.equal(jumper.indices(step), history[step])

    resumed = GlobalBatchSampler(num_blocks=37, global_batch_size=8, seed=0)
    resumed.load_state_dict(sequential.state_dict())
    assert torch.equal(resumed.indices(20), history[20])
    with pytest.raises(ValueError, match=r"num_blocks=37.*num_blocks=36"):
        GlobalBatchSampler(num_blocks=36, global_batch_size=8, seed=11).load_state_dict(sequential.state_dict())


@pytest.mark.parametrize("dp_size,accumulation_steps", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_local_microbatch_covers_global_batch(dp_size: int, accumulation_steps: int) -> None:
    global_indices = GlobalBatchSampler(num_blocks=100, global_batch_size=8, seed=0).indices(5)
    pieces = [
        local_microbatch(global_indices, rank, dp_size, accumulation_steps, micro)
        for micro in range(accumulation_steps)
        for rank in range(dp_size)
    ]
    assert all(p.numel() == 8 // (dp_size * accumulation_steps) for p in pieces)
    assert torch.equal(torch.cat(pieces), global_indices)


def test_local_microbatch_divisibility_error() -> None:
    global_indices = torch.arange(6)
    with pytest.raises(ValueError, match=r"global_batch_size=6 .*2 \* 2 = 4"):
        local_microbatch(global_indices, 0, 2, 2, 0)
    with pytest.raises(ValueError, match=r"dp_rank=2"):
        local_microbatch(global_indices, 2, 2, 1, 0)
