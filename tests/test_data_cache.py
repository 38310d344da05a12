"""The token cache: tokenized once, reused, invalidated, never half-read; inputs; waiting ranks; prepare-data."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.base.config import ParallelConfig
from plait.cli import main
from plait.cp.sequence import read_spans
from plait.data import GlobalBatchSampler, default_corpus_path, train_bpe_tokenizer
from plait.data.blocks import TokenBlocks, training_blocks
from plait.data.cache import ByteEncoder, TokenCache, TokenizerEncoder
import plait.data.cache as cache_module
from plait.data.sources import resolve_sources, sample_lines
import plait.data.sources as sources_module
from plait.run.train_args import TrainArgs
from plait.run.train_data import load_data, prepare_data
import plait.run.trainer
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def corpus_slice(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "slice.txt"
    path.write_text(default_corpus_path().read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus_slice):
    return train_bpe_tokenizer([corpus_slice], 300)


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def encode_calls(monkeypatch) -> list[int]:
    """Every encoder call (byte or tokenizer), as the number of pieces it encoded."""
    calls: list[int] = []
    for cls in (ByteEncoder, TokenizerEncoder):
        original = cls.encode

        def spy(self, texts, _original=original):
            calls.append(len(texts))
            return _original(self, texts)

        monkeypatch.setattr(cls, "encode", spy)
    return calls


def entries(root: Path) -> list[str]:
    """Everything under the cache's tokens dir (complete entries and anything left over)."""
    tokens = root / "tokens"
    return sorted(p.name for p in tokens.iterdir()) if tokens.exists() else []


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def cache_tokens(root: Path, sources, encoder) -> list[int]:
    cache = TokenCache(root, sources, encoder)
    cache.ensure(progress=False)
    return cache.tokens().tolist()


# -- reuse and invalidation ---------------------------------------------------------------------------------

def test_second_run_reads_the_cache_without_tokenizing(corpus_slice, tokenizer_dir, tmp_path, encode_calls):
    args = TrainArgs(train_file=str(corpus_slice), tokenizer_name=str(tokenizer_dir), block_size=16,
                     data_cache_dir=str(tmp_path))
    first = prepare_data(args, 300, progress=False)
    assert first.prepared == ["train"] and encode_calls
    tokens_file = first.train.path / cache_module.TOKENS_FILE
    before = tokens_file.stat()
    encode_calls.clear()
    second = prepare_data(args, 300, progress=False)
    assert second.prepared == [] and encode_calls == []  # nothing tokenized
    after = tokens_file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # the same file, untouched
    assert torch.equal(second.blocks.tensor(), first.blocks.tensor())
    # block_size is not part of the key: another block size cuts the same cached stream
    other = prepare_data(TrainArgs(**{**vars(args), "block_size": 32}), 300, progress=False)
    assert other.prepared == [] and other.train.path == first.train.path and len(other.blocks) == len(first.blocks) // 2


def test_changed_file_is_tokenized_again(tmp_path, encode_calls):
    text = tmp_path / "a.txt"
    text.write_text("first version of the text " * 20)
    root = tmp_path / "cache"
    old = TokenCache(root, resolve_sources(text), ByteEncoder(61))
    old.ensure(progress=False)
    text.write_text("second version, other text " * 20)
    new = TokenCache(root, resolve_sources(text), ByteEncoder(61))
    assert new.path != old.path and not new.is_complete()
    encode_calls.clear()
    new.ensure(progress=False)
    assert encode_calls
    assert bytes(new.tokens().astype(np.uint8)) == bytes(b % 61 for b in text.read_bytes())
    # the same bytes with a new mtime: the identity changed, so it is not trusted either
    os.utime(text, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert TokenCache(root, resolve_sources(text), ByteEncoder(61)).path != new.path


def test_changed_tokenizer_is_tokenized_again(corpus_slice, tmp_path):
    sources = resolve_sources(corpus_slice)
    small, large = train_bpe_tokenizer([corpus_slice], 300), train_bpe_tokenizer([corpus_slice], 400)
    root = tmp_path / "cache"
    a, b = TokenCache(root, sources, TokenizerEncoder(small)), TokenCache(root, sources, TokenizerEncoder(large))
    assert a.path != b.path
    a.ensure(progress=False)
    b.ensure(progress=False)
    assert a.tokens().tolist() != b.tokens().tolist()
    # a tokenizer dir rewritten with other content: another key, though the path is the same
    small.save_pretrained(tmp_path / "tok")
    key_small = TokenizerEncoder(plait_load(tmp_path / "tok")).key
    large.save_pretrained(tmp_path / "tok")
    assert TokenizerEncoder(plait_load(tmp_path / "tok")).key != key_small


def plait_load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# -- contents --------------------------------------------------------------------------------------------------

def test_eos_between_documents(tokenizer, tmp_path):
    docs = ["First document.", "Second one,\nwith two lines.", "Third"]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n\n")
    cache = TokenCache(tmp_path / "cache", resolve_sources(data), TokenizerEncoder(tokenizer))
    cache.ensure(progress=False)
    eos = tokenizer.eos_token_id
    expected = [i for d in docs for i in ids_of(tokenizer, d) + [eos]]
    assert cache.tokens().tolist() == expected
    assert cache.document_ends().tolist() == list(np.cumsum([len(ids_of(tokenizer, d)) + 1 for d in docs]))
    assert cache.meta["num_documents"] == 3


@pytest.mark.parametrize("vocab", [61, 300])
def test_blocks_and_global_batch_equal_the_in_memory_path(corpus_slice, tmp_path, vocab):
    """Bytes (tiny models) and a trained BPE: the cache's blocks are today's blocks, so every global batch is."""
    args = TrainArgs(train_file=str(corpus_slice), block_size=16, data_cache_dir=str(tmp_path / "cache"))
    data = prepare_data(args, vocab, progress=False)
    reference, _ = training_blocks([corpus_slice], 16, vocab, cache_dir=tmp_path / "ref-tokenizers")
    assert isinstance(data.blocks, TokenBlocks) and data.blocks.shape == reference.shape
    assert torch.equal(data.blocks.tensor(), reference)
    sampler = GlobalBatchSampler(len(data.blocks), 8, seed=3)
    for step in (0, 5, 1000):
        rows = sampler.indices(step)
        assert torch.equal(data.blocks[rows], reference[rows])
    # the trainer's evaluation slicing: views of views, then .to()
    usable = len(data.blocks) // 4 * 4
    mine = data.blocks[:usable][1::2]
    assert len(mine) == len(reference[:usable][1::2]) and mine.shape[1] == 16
    assert torch.equal(mine[3:7].to("cpu"), reference[:usable][1::2][3:7])
    assert torch.equal(data.blocks[-1], reference[-1]) and torch.equal(data.blocks[[2, -2]], reference[[2, -2]])
    # a context-parallel rank's read: its two chunks and each one's next token, nothing else
    for cp, cp_rank in ((2, 0), (2, 1), (4, 3)):
        spans = read_spans(16, cp, cp_rank)
        held = torch.zeros(16, dtype=torch.bool)
        for a, b in spans:
            held[a:b] = True
        part = data.blocks.read_spans(rows, spans)
        assert torch.equal(part[:, held], reference[rows][:, held]) and not part[:, ~held].any()
        assert held.sum() <= 16 // cp + 2  # the slice, and the labels of its chunks' last tokens


def test_txt_pieces_tokenize_like_the_whole_file(tokenizer, tmp_path, monkeypatch):
    """A .txt file is one document read in pieces; cut where byte-level BPE cannot join text, the pieces give the
    ids of the whole file: trailing spaces, CRLF across read chunks, multi-byte characters, a long line."""
    monkeypatch.setattr(sources_module, "PIECE_CHARS", 300)
    monkeypatch.setattr(sources_module, "READ_CHUNK", 257)
    monkeypatch.setattr(cache_module, "BATCH_CHARS", 1000)
    text = ("Line with trailing spaces   \r\nthen  a tab\tand ümlauts éé 🙂\r\n\r\n  indented line\n" * 40
            + "a-very-long-line-without-newlines " * 60 + "\n" + "x" * 1000 + "\rend")
    path = tmp_path / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    whole = text.replace("\r\n", "\n").replace("\r", "\n")
    got = cache_tokens(tmp_path / "cache", resolve_sources(path), TokenizerEncoder(tokenizer))
    assert got == ids_of(tokenizer, whole) + [tokenizer.eos_token_id]


# -- crashes, partial entries, concurrent preparers ---------------------------------------------------------

def test_crash_midway_leaves_nothing_that_looks_complete(corpus_slice, tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "PIECE_CHARS", 2000)
    monkeypatch.setattr(cache_module, "BATCH_CHARS", 5000)
    calls = []
    original = ByteEncoder.encode

    def failing(self, texts):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated crash while tokenizing")
        return original(self, texts)

    monkeypatch.setattr(ByteEncoder, "encode", failing)
    root = tmp_path / "cache"
    cache = TokenCache(root, resolve_sources(corpus_slice), ByteEncoder(61))
    with pytest.raises(RuntimeError, match="simulated crash"):
        cache.ensure(progress=False)
    assert entries(root) == [] and not cache.is_complete()  # no entry, no temporary, no lock
    monkeypatch.setattr(ByteEncoder, "encode", original)
    cache.ensure(progress=False)
    assert entries(root) == [cache.path.name]
    assert bytes(cache.tokens().astype(np.uint8)) == bytes(b % 61 for b in corpus_slice.read_bytes())


def test_killed_preparation_and_partial_entry_are_ignored(corpus_slice, tmp_path, encode_calls):
    """What a kill -9 leaves (a temporary dir of a dead process) and an entry with a short tokens file (a
    partial copy) are neither read nor kept."""
    root = tmp_path / "cache"
    cache = TokenCache(root, resolve_sources(corpus_slice), ByteEncoder(61))
    dead = cache.path.parent / f".{cache.path.name}.tmp-{cache_module._host()}-{2**22 + 12345}"
    dead.mkdir(parents=True)
    (dead / cache_module.TOKENS_FILE).write_bytes(b"\0" * 100)
    cache.ensure(progress=False)
    assert entries(root) == [cache.path.name]  # the dead process's temporary was removed
    good = cache.tokens().tolist()
    with open(cache.path / cache_module.TOKENS_FILE, "r+b") as f:
        f.truncate(1000)
    assert not cache.is_complete()
    encode_calls.clear()
    meta, prepared = cache.ensure(progress=False)
    assert prepared and encode_calls and cache.tokens().tolist() == good


def test_two_preparers_at_once_make_one_cache(corpus_slice, tmp_path, monkeypatch):
    """Two local-rank-0 processes (e.g. two nodes on a shared file system) start together: one tokenizes, the
    other waits on the lock and reads its entry."""
    prepared = []
    original = TokenCache._write

    def slow_write(self, tmp, progress):
        prepared.append(threading.get_ident())
        time.sleep(0.5)
        return original(self, tmp, progress)

    monkeypatch.setattr(TokenCache, "_write", slow_write)
    root = tmp_path / "cache"
    results, errors = [], []

    def run():
        try:
            cache = TokenCache(root, resolve_sources(corpus_slice), ByteEncoder(61))
            results.append(cache.ensure(local_rank=0, progress=False))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a cache writer thread hangs"
    assert not errors and len(prepared) == 1
    assert sorted(made for _, made in results) == [False, True]
    assert len(entries(root)) == 1 and not entries(root)[0].startswith(".")


def test_other_local_ranks_wait_for_the_file(corpus_slice, tmp_path, encode_calls):
    args = TrainArgs(train_file=str(corpus_slice), block_size=16, data_cache_dir=str(tmp_path))
    waited = {}

    def rank1():
        start = time.monotonic()
        waited["data"] = prepare_data(args, 61, local_rank=1, progress=False)
        waited["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=rank1)
    thread.start()
    time.sleep(0.6)
    assert thread.is_alive() and not encode_calls  # rank 1 waits and tokenizes nothing
    rank0 = prepare_data(args, 61, local_rank=0, progress=False)
    thread.join(timeout=30)
    assert waited["seconds"] >= 0.5 and waited["data"].prepared == [] and rank0.prepared == ["train"]
    assert torch.equal(waited["data"].blocks.tensor(), rank0.blocks.tensor())


def test_waiting_rank_gives_up_when_nobody_prepares(corpus_slice, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = TrainArgs(train_file=str(corpus_slice), block_size=16, data_cache_dir=str(tmp_path), ddp_timeout=1)
    start = time.monotonic()
    with pytest.raises(plait.base.config.ConfigError) as info:
        load_data(args, 61)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "waited 1 s for the tokenized data" in message and str(tmp_path / "tokens") in message
    assert "plait prepare-data" in message


def test_waiting_rank_waits_while_the_preparer_is_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "HEARTBEAT_S", 0.1)
    final = tmp_path / "entry"
    done = threading.Event()

    def preparer():
        with cache_module.exclusive(final, final.exists, 10, "x") as mine:
            assert mine
            time.sleep(2.0)  # longer than the waiter's timeout: its heartbeat keeps the waiter waiting
            final.mkdir()
        done.set()

    thread = threading.Thread(target=preparer)
    thread.start()
    time.sleep(0.2)
    cache_module.wait_for(final, final.exists, timeout=1.0, what="x")
    thread.join(timeout=60)
    assert not thread.is_alive(), "the preparer thread hangs"
    assert done.is_set() and sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no lock or busy file left


# -- inputs ----------------------------------------------------------------------------------------------------

def test_jsonl_text_field(tokenizer, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"content": "alpha beta", "text": 3}) + "\n" + json.dumps({"content": "gamma"}) + "\n")
    args = TrainArgs(train_file=str(data), text_field="content", block_size=2, data_cache_dir=str(tmp_path / "c"))
    got = prepare_data(args, 61, progress=False).train.tokens().tolist()
    assert got == [b % 61 for b in b"alpha betagamma"]  # byte ids: documents concatenated, as before
    with pytest.raises(ValueError, match=r'd.jsonl:1: "text" is a number \(3\), not a string; .*--text_field'):
        prepare_data(TrainArgs(**{**vars(args), "text_field": "text"}), 61, progress=False)


def test_directory_and_glob_inputs(tokenizer, tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "b.txt").write_text("bee text")
    (data / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    (data / "sub" / "c.txt").write_text("sea text")
    (data / ".hidden.txt").write_text("never")
    (data / "notes.md").write_text("never")
    sources = resolve_sources(data)
    assert [s.path.relative_to(data).as_posix() for s in sources] == ["a.jsonl", "b.txt", "sub/c.txt"]
    assert [s.kind for s in sources] == ["jsonl", "txt", "txt"]
    assert [s.path for s in resolve_sources(str(data / "**" / "*.txt"))] == [data / "b.txt", data / "sub" / "c.txt"]
    eos = tokenizer.eos_token_id
    got = cache_tokens(tmp_path / "cache", sources, TokenizerEncoder(tokenizer))
    assert got == [i for d in ("one", "two", "bee text", "sea text") for i in ids_of(tokenizer, d) + [eos]]
    with pytest.raises(ValueError, match=r"matches no file"):
        resolve_sources(str(data / "*.parquet"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"directory without \.txt, \.jsonl or \.parquet files"):
        resolve_sources(tmp_path / "empty_dir")


def test_parquet_input(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    texts = [f"row {i} of the parquet file" for i in range(2500)] + [None, ""]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), path, row_group_size=1000)
    eos = tokenizer.eos_token_id
    got = cache_tokens(tmp_path / "cache", resolve_sources(path, text_field="body"), TokenizerEncoder(tokenizer))
    assert got == [i for t in texts if t for i in ids_of(tokenizer, t) + [eos]]
    with pytest.raises(ValueError, match=r"no 'text' column; choose one with --text_field"):
        cache_tokens(tmp_path / "cache", resolve_sources(path), TokenizerEncoder(tokenizer))


def test_datasets_dir_equals_jsonl_of_the_same_texts(tokenizer_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"line {i} of a local dataset" for i in range(300)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    common = dict(tokenizer_name=str(tokenizer_dir), block_size=8, data_cache_dir=str(tmp_path / "c"))
    from_ds = prepare_data(TrainArgs(dataset_name=str(tmp_path / "ds"), **common), 300, progress=False)
    from_jsonl = prepare_data(TrainArgs(train_file=str(tmp_path / "d.jsonl"), **common), 300, progress=False)
    assert from_ds.train.path != from_jsonl.train.path
    assert from_ds.train.tokens().tolist() == from_jsonl.train.tokens().tolist()


def test_validation_uses_the_training_tokenizer(corpus_slice, tmp_path):
    """Without --tokenizer_name the BPE is trained on the training data only; validation text is encoded with it."""
    val = tmp_path / "val.txt"
    val.write_text("to be or not to be, that is the question " * 20)
    args = TrainArgs(train_file=str(corpus_slice), validation_file=str(val), block_size=8,
                     data_cache_dir=str(tmp_path / "c"))
    data = prepare_data(args, 300, progress=False)
    assert data.validation.tokens().tolist() == ids_of(data.tokenizer, val.read_text()) + [data.tokenizer.eos_token_id]
    assert len(list((tmp_path / "c" / "tokenizers").iterdir())) == 1


def test_bpe_sample_is_bounded(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("".join(f"alpha line {i}\n" for i in range(3000)))
    b.write_text("".join(f"beta line {i}\n" for i in range(1000)))
    sources = resolve_sources(tmp_path)
    lines = list(sample_lines(sources, 4000))
    taken = sum(map(len, lines))
    assert 4000 <= taken < 4000 + 2 * 20  # each file stops at the first line past its share
    share_a = sum(len(x) for x in lines if x.startswith("alpha"))
    assert 2900 < share_a < 3100  # in proportion to size: a is 3/4 of the corpus
    assert lines[0] == "alpha line 0\n" and "beta line 0\n" in lines
    whole = list(sample_lines(sources, 10**9))
    assert "".join(whole) == a.read_text() + b.read_text()  # smaller than the budget: all of it


# -- bad input through plait train: one line, before any process group, no cache left behind --------------

def write_model(tmp_path: Path, vocab_size: int = 61) -> str:
    path = tmp_path / "config.json"
    path.write_text(tiny_config("llama", vocab_size=vocab_size).to_json_string())
    return str(path)


BAD_INPUTS = [
    ("binary_file", 61, lambda p: p.write_bytes(b"text at first\n" * 5 + b"\x00\x01\x02 binary"), "bin.txt",
     r"bin.txt: a NUL byte at byte offset 70; it is not UTF-8 text"),
    ("invalid_utf8", 300, lambda p: p.write_bytes(b"caf\xc3\xa9 ok\n" * 3 + b"bad \xff byte"), "latin.txt",
     r"latin.txt: invalid UTF-8 \(byte 0xff: invalid start byte\) at byte offset 31"),
    ("empty_corpus", 300, lambda p: p.write_text("\n\n"), "empty.jsonl", r"empty.jsonl: the file is empty"),
    ("jsonl_without_field", 61, lambda p: p.write_text('{"text": "ok"}\n{"body": "no text"}\n'), "d.jsonl",
     r'd.jsonl:2: expected a JSON object with a string "text" field \(found: body\); choose the field with '
     r'--text_field'),
    ("jsonl_not_json", 61, lambda p: p.write_text('{"text": "ok"}\nnot json\n'), "d.jsonl",
     r"d.jsonl:2 \(byte offset 15\): not valid JSON"),
    ("tokenizer_larger_than_model", 290, None, "slice.txt", r"has 300 tokens, more than the model's vocab_size=290"),
]


@pytest.mark.parametrize("vocab, write, name, message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_fails_at_once_and_leaves_no_cache(tmp_path, monkeypatch, capsys, corpus_slice, tokenizer_dir,
                                                     vocab, write, name, message):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(plait.run.trainer, "init_distributed", lambda *a, **k: pytest.fail("reached torch.distributed"))
    path = corpus_slice if write is None else tmp_path / name
    if write is not None:
        write(path)
    flags = ["--model_config", write_model(tmp_path, vocab), "--train_file", str(path), "--block_size", "8",
             "--output_dir", str(tmp_path / "out"), "--data_cache_dir", str(tmp_path / "cache")]
    if write is None:
        flags += ["--tokenizer_name", str(tokenizer_dir)]
    with pytest.raises(SystemExit) as info:
        main(["train", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert re.search(message, err[-1]), err[-1]
    assert not (tmp_path / "out").exists()
    leftovers = [p for p in (tmp_path / "cache").rglob("*")] if (tmp_path / "cache").exists() else []
    assert [p for p in leftovers if p.is_file()] == []  # no tokens, no tokenizer, no lock


def test_bad_data_past_the_bpe_sample_removes_the_bpe_too(tmp_path, monkeypatch, capsys):
    """The BPE trains on the first 1,000 characters; the NUL byte is found later, by tokenization: the run
    fails with the offset and leaves neither tokens nor the BPE it trained for them."""
    import plait.data.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "BPE_SAMPLE_CHARS", 1000)
    monkeypatch.setattr(sources_module, "READ_CHUNK", 4096)
    monkeypatch.setattr(sources_module, "PIECE_CHARS", 500)
    path = tmp_path / "late.txt"
    path.write_bytes(b"good text line\n" * 1000 + b"\x00")
    with pytest.raises(SystemExit):
        main(["train", "--model_config", write_model(tmp_path, 300), "--train_file", str(path), "--block_size", "8",
              "--output_dir", str(tmp_path / "out"), "--data_cache_dir", str(tmp_path / "cache")])
    assert "late.txt: a NUL byte at byte offset 15,000" in capsys.readouterr().err.strip().splitlines()[-1]
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == []


def test_unreadable_file_and_unwritable_cache(tmp_path, monkeypatch):
    """(As root, permissions do not stop a read, so the refusal of the open is simulated.)"""
    path = tmp_path / "locked.txt"
    path.write_text("text")
    original = Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(ValueError, match=r"cannot read .*locked.txt: Permission denied; check the path and its "):
        list(resolve_sources(path)[0].pieces())
    monkeypatch.setattr(Path, "open", original)
    (tmp_path / "file").write_text("not a directory")
    args = TrainArgs(train_file=str(path), block_size=2, data_cache_dir=str(tmp_path / "file" / "cache"))
    with pytest.raises(ValueError, match=r"cannot write the data cache in .*file/cache .*--data_cache_dir"):
        prepare_data(args, 61, progress=False)


# -- the trainer and plait prepare-data ------------------------------------------------------------------------

def test_training_reads_the_cache(tmp_path, encode_calls):
    config = write_model(tmp_path)
    common = dict(model_config=config, max_steps=2, per_device_train_batch_size=2, block_size=16,
                  data_cache_dir=str(tmp_path / "cache"))
    first = plait.run.trainer.train(TrainArgs(output_dir=str(tmp_path / "a"), **common))
    assert encode_calls
    encode_calls.clear()
    second = plait.run.trainer.train(TrainArgs(output_dir=str(tmp_path / "b"), **common))
    assert encode_calls == []
    assert [r["loss"] for r in second] == [r["loss"] for r in first]


def test_prepare_data_prints_documents_tokens_blocks_epochs(tmp_path, capsys, tokenizer):
    docs = [f"document {i}: " + "words " * (i % 7 + 1) for i in range(50)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cache = tmp_path / "cache"
    argv = ["prepare-data", "--model_config", write_model(tmp_path), "--train_file", str(data), "--block_size", "16",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--nproc_per_node", "4",
            "--tensor_parallel_size", "2", "--max_steps", "30", "--data_cache_dir", str(cache)]
    main(argv)
    out = capsys.readouterr().out
    tokens = sum(len(d.encode()) for d in docs)  # the tiny model's byte ids
    blocks = tokens // 16
    assert f"-> 50 documents, {tokens:,} tokens (uint16), {blocks:,} blocks of 16 tokens; tokenized now" in out
    assert "global batch: 16 blocks (4 per device x dp 2 x 2 accumulation steps) = 256 tokens per step" in out
    assert f"--max_steps 30: 480 blocks = {480 / blocks:.3f} epochs of the training data" in out
    main(argv)
    assert "; from the cache" in capsys.readouterr().out


def test_prepare_data_global_batch_is_the_runs_at_cp2(tmp_path, capsys):
    """cp ranks split each sequence, they take no batch of their own: 4 processes at cp=2 are dp=2, as the trainer's
    mesh derives it (ParallelConfig.resolve), not dp=4 (what prepare-data once printed, leaving cp out)."""
    data = tmp_path / "d.txt"
    data.write_text("some words " * 200)
    argv = ["prepare-data", "--model_config", write_model(tmp_path), "--train_file", str(data), "--block_size", "16",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--nproc_per_node", "4",
            "--context_parallel_size", "2", "--max_steps", "3", "--data_cache_dir", str(tmp_path / "cache")]
    main(argv)
    assert ParallelConfig(cp=2).resolve(4).dp == 2  # the run's dp, from the same data_parallel_size
    assert "global batch: 16 blocks (4 per device x dp 2 x 2 accumulation steps) = 256 tokens per step" in \
        capsys.readouterr().out
    main([*argv, "--world_size", "8", "--tensor_parallel_size", "2"])  # 8 / (tp 2 * cp 2): dp 2 again
    assert "(4 per device x dp 2 x 2 accumulation steps)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # 6 processes cannot hold tp 1 * cp 2 * pp 2 = 4: the run's refusal
        main([*argv, "--world_size", "6", "--pipeline_parallel_size", "2"])
    assert "world size 6 is not divisible by tp*cp*pp = 1*2*2 = 4" in capsys.readouterr().err


def test_train_file_may_be_a_glob(tmp_path):
    from plait.base.config import ConfigError
    from plait.run.train_args import TrainArgs

    (tmp_path / "a.txt").write_text("some text")
    TrainArgs(train_file=str(tmp_path / "*.txt"), output_dir=str(tmp_path / "out")).validate()
    with pytest.raises(ConfigError, match=r"--train_file '.*\*\.jsonl' does not exist \(nor matches a file as a glob\)"):
        TrainArgs(train_file=str(tmp_path / "*.jsonl"), output_dir=str(tmp_path / "out")).validate()
