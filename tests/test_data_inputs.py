"""Input files the data layer refuses, or now reads, in one line naming the file (and line and byte): not UTF-8 in
any .jsonl reader, a BOM, corrupt Parquet, links in directories, .json files, data shorter than a block, an idle
--text_field on SFT data, categorical Parquet text, non-string text fields, an unreadable first file; an SFT layout
that fails keeps its tokens for the run that fixes it."""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest

import plait.data.sources as sources_module
from plait.base.config import ConfigError
from plait.data.sft import load_sft_data, read_records
from plait.data.sft_records import SFTSource, data_format
from plait.data.sources import resolve_sources
from plait.run.train_args import TrainArgs
from plait.run.train_data import prepare_data

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PAIR = {"prompt": "two plus two", "completion": "four"}


def texts(path: Path, text_field: str = "text") -> list[str]:
    """The documents the streaming reader gives for one file (each short enough to be one piece)."""
    return [text for text, _, _ in resolve_sources(path, text_field)[0].pieces()]


def latin1_lines(path: Path, record: dict, good_first: bool = True) -> Path:
    """``record`` as a .jsonl line, then (or only, without ``good_first``) as one with a Latin-1 é (0xe9) where
    UTF-8 has two bytes."""
    good = json.dumps(record) + "\n"
    bad = good.replace("hello", "café").replace("four", "café").encode("latin-1")
    path.write_bytes(good.encode() + bad if good_first else bad)
    return path


# -- 1. not UTF-8, binary, BOM: the same line from every .jsonl reader ----------------------------------------------

@pytest.mark.parametrize("record, fmt", [(CHAT, "chat"), (PAIR, "prompt_completion"), ({"text": "hello"}, "text")])
def test_invalid_utf8_names_file_line_and_byte_in_every_reader(tmp_path, record, fmt):
    """The format's reader meets it on line 2; --data_format auto, reading the first line, on line 1."""
    later = latin1_lines(tmp_path / "later.jsonl", record)
    first = latin1_lines(tmp_path / "first.jsonl", record, good_first=False)
    read = (lambda: list(resolve_sources(later)[0].pieces())) if fmt == "text" else (
        lambda: list(read_records(later, fmt)))
    for path, line, call in ((later, 2, read), (first, 1, lambda: data_format(SFTSource(train_file=str(first))))):
        offset = path.read_bytes().index(b"\xe9")
        with pytest.raises(ValueError) as info:  # was: 'utf-8' codec can't decode byte 0xe9 in position N ...
            call()
        assert str(info.value) == (f"{path}: line {line}: invalid UTF-8 (byte 0xe9: invalid continuation byte) at "
                                   f"byte offset {offset}; it is not UTF-8 text: re-encode it (iconv -f ENCODING -t "
                                   f"UTF-8), or give .parquet")


def test_image_text_rows_name_the_line_of_invalid_utf8(tmp_path):
    """The vision reader reads .jsonl lines through the same reader, so it names the line and the fix too."""
    from plait.data.vision import read_rows

    path = latin1_lines(tmp_path / "rows.jsonl", CHAT)
    offset = path.read_bytes().index(b"\xe9")
    with pytest.raises(ConfigError) as info:  # was: rows.jsonl: cannot be read ('utf-8' codec can't decode ...)
        read_rows(path)
    assert str(info.value) == (f"{path}: line 2: invalid UTF-8 (byte 0xe9: invalid continuation byte) at byte "
                               f"offset {offset}; it is not UTF-8 text: re-encode it (iconv -f ENCODING -t UTF-8), "
                               f"or give .parquet")


def test_bad_validation_file_is_named_by_the_sft_loader(tmp_path):
    """Validation lines go through the same reader: the loader's one line names the file, line and byte."""
    from plait.data.chat_tokenizer import save_chat_tokenizer

    tokenizer = save_chat_tokenizer(["hi hello café four"] * 20, 300, tmp_path / "tok")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(CHAT) + "\n")
    latin1_lines(tmp_path / "val.jsonl", CHAT)
    source = SFTSource(train_file=str(train), validation_file=str(tmp_path / "val.jsonl"),
                       tokenizer_name=str(tokenizer), block_size=32, data_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"val.jsonl: line 2: invalid UTF-8 \(byte 0xe9: invalid continuation byte"):
        load_sft_data(source, 300, report=False)


def test_binary_jsonl_is_refused_by_its_nul_byte(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"ab\0c\n")
    message = r"bin.jsonl: line 1: a NUL byte at byte offset 2; it is not UTF-8 text"
    with pytest.raises(ValueError, match=message):  # was: "line 1: not valid JSON"
        data_format(SFTSource(train_file=str(path)))
    with pytest.raises(ValueError, match=message):
        list(read_records(path, "chat"))


def test_a_bom_is_read_as_utf8_sig_by_every_reader(tmp_path):
    bom = b"\xef\xbb\xbf"
    pairs = tmp_path / "bom.jsonl"
    pairs.write_bytes(bom + json.dumps(PAIR).encode() + b"\n")
    assert data_format(SFTSource(train_file=str(pairs))) == "prompt_completion"  # was: Unexpected UTF-8 BOM
    assert [r for _, r in read_records(pairs, "prompt_completion")] == [PAIR]
    text = tmp_path / "text.jsonl"
    text.write_bytes(bom + b'{"text": "caf\xc3\xa9"}\n')
    assert data_format(SFTSource(train_file=str(text))) == "text"
    assert texts(text) == ["café"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(bom + b'{"text": 1,}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 \(byte offset 14\): not valid JSON"):  # offsets count the BOM
        texts(bad)


def test_txt_offset_of_a_character_cut_by_a_read_chunk(tmp_path, monkeypatch):
    """A character whose first byte ends one chunk is reported at that byte, not at the next chunk's start."""
    monkeypatch.setattr(sources_module, "READ_CHUNK", 4)
    path = tmp_path / "cut.txt"
    path.write_bytes(b"abc\xc3(def")
    with pytest.raises(ValueError, match=r"cut.txt: invalid UTF-8 \(byte 0xc3: invalid continuation byte\) at byte "
                                         r"offset 3;"):
        texts(path)


# -- 2. Parquet that is not readable -------------------------------------------------------------------------------

def test_corrupt_or_cut_parquet_is_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1garbage")
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [f"row {i} of the table" for i in range(300)]}), good)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:1500])
    for path in (garbage, cut):
        with pytest.raises(ValueError, match=rf"^{path}: not a readable Parquet file \(.*\); it may be truncated or "
                                             r"not Parquet: write it again$"):
            texts(path)


# -- 3. links in directories ---------------------------------------------------------------------------------------

def test_links_to_directories_are_followed_and_broken_or_repeated_ones_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("linked text")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("own text")
    (data / "more").symlink_to(elsewhere)
    assert [s.path.relative_to(data).as_posix() for s in resolve_sources(data)] == ["a.txt", "more/b.txt"]
    (elsewhere / "loop").symlink_to(data)  # data/more/loop -> data: read forever
    with pytest.raises(ValueError, match=r"--train_file .*data: .*more/loop links back to .*data, a directory that "
                                         r"encloses it"):
        resolve_sources(data)
    (elsewhere / "loop").unlink()
    (data / "again").symlink_to(elsewhere)  # more/b.txt and again/b.txt: one file, read twice before
    for spec in (data, data / "*" / "*.txt"):
        with pytest.raises(ValueError, match=r"--train_file .*: .*data/again/b.txt and .*data/more/b.txt are one file "
                                             r"\(.*elsewhere/b.txt\), which would be read twice"):
            resolve_sources(spec)
    (data / "again").unlink()
    (data / "gone.txt").symlink_to(tmp_path / "nonexistent")
    message = r"--train_file .*data/gone.txt is a broken symbolic link \(to .*nonexistent, which does not exist\)"
    for spec in (data, data / "gone.txt", data / "*.txt"):
        with pytest.raises(ValueError, match=message):
            resolve_sources(spec)


# -- 4. .json files ------------------------------------------------------------------------------------------------

def test_json_files_are_refused_with_the_rename(tmp_path):
    path = tmp_path / "export.json"
    path.write_text(json.dumps({"text": "a"}) + "\n")  # what datasets' Dataset.to_json("export.json") writes
    message = r"--validation_file .*export.json: .json files are not read .*; rename it to .jsonl .* or to .txt"
    for spec in (path, tmp_path / "*.json"):
        with pytest.raises(ValueError, match=message):
            resolve_sources(spec, flag="--validation_file")
    (tmp_path / "a.txt").write_text("text")
    assert [s.path.name for s in resolve_sources(tmp_path)] == ["a.txt"]  # a directory's .json files are not data


# -- 5. fewer tokens than one block ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["train_file", "validation_file"])
def test_data_shorter_than_a_block_names_the_flag_and_leaves_no_entry(tmp_path, flag):
    long, short = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_text("enough text for several blocks " * 4)
    short.write_text("hello")
    files = {"train_file": str(short if flag == "train_file" else long)}
    if flag == "validation_file":
        files["validation_file"] = str(short)
    args = TrainArgs(**files, block_size=16, data_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"^--{flag} .*short.txt: 5 tokens are fewer than one block of "
                                         r"--block_size=16; use --block_size 5 or less, or give more data$"):
        prepare_data(args, 61, progress=False)  # the tiny vocabulary's byte ids: one token a byte
    entries = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "tokens").iterdir())
    assert entries == ([] if flag == "train_file" else ["long.txt"])


@pytest.mark.parametrize("overlong, message", [
    ("refuse", r"long.jsonl line 1: the example has \d+ tokens, more than --block_size=8; raise --block_size"),
    ("drop", r"^no SFT example is left to train on \(of 1, --overlong drop dropped 1\)"),
    ("truncate", r"long.jsonl: no example has a token left to train on after --block_size=8 truncation")])
def test_a_failed_sft_layout_keeps_its_tokens_for_the_fix(tmp_path, overlong, message):
    """The SFT entry holds the tokenized examples, whatever the block size (--block_size, --packing and --overlong
    are not in its key: blocks are laid out when read). A layout that refuses them leaves that complete entry, so
    the run the refusal asks for (a larger --block_size) reads it rather than tokenizing the data again."""
    from plait.data.chat_tokenizer import save_chat_tokenizer

    tokenizer = save_chat_tokenizer(["hi hello four " * 10] * 20, 300, tmp_path / "tok")
    train = tmp_path / "long.jsonl"  # the answer lies past --block_size: nothing of it survives truncation
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "hi " * 40},
                                              {"role": "assistant", "content": "four"}]}) + "\n")
    source = SFTSource(train_file=str(train), tokenizer_name=str(tokenizer), block_size=8, overlong=overlong,
                       data_cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=message):
        load_sft_data(source, 300, report=False)
    [entry] = (tmp_path / "cache" / "sft").iterdir()
    built = entry.stat().st_ino
    load_sft_data(dataclasses.replace(source, block_size=128), 300, report=False)
    assert [e.stat().st_ino for e in (tmp_path / "cache" / "sft").iterdir()] == [built]  # read, not built again


# -- 6. --text_field on SFT data -------------------------------------------------------------------------------------

@pytest.mark.parametrize("record, fmt", [(CHAT, "chat"), (PAIR, "prompt_completion")])
def test_text_field_on_sft_data_is_refused(tmp_path, record, fmt):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=rf"^--text_field has no effect: .* this data is {fmt} .*; drop it$"):
        load_sft_data(TrainArgs(train_file=str(path), text_field="body").sft_source(), 300)


# -- 7. categorical and string_view Parquet text ---------------------------------------------------------------------

def test_dictionary_and_string_view_columns_are_text(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = ["red", None, "blue", "red"]
    for name, column in (("categorical", pa.array(rows).dictionary_encode()),
                         ("large_categorical", pa.array(rows, pa.large_string()).dictionary_encode()),
                         ("view", pa.array(rows, pa.string_view()))):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": column}), path)
        assert not pa.types.is_string(pq.ParquetFile(path).schema_arrow.field("text").type)  # not decoded by pyarrow
        assert texts(path) == ["red", "blue", "red"], name
    with pytest.raises(ValueError, match=r"column 'text' holds dictionary<values=int64.*not text; choose a text col"):
        sources_module._as_strings(pa.array([1, 2]).dictionary_encode(), tmp_path / "numbers.parquet", "text")


# -- 8. the text field's value: null skipped (as in Parquet), anything else but a string refused --------------------

def test_null_text_is_skipped_and_other_values_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": null}\n{"text": "c"}\n')
    assert texts(path) == ["a", "c"]
    for value, found in (("5", r"a number \(5\)"), ("true", r"a boolean \(true\)"), ('["x"]', r'a list \(\["x"\]\)')):
        path.write_text('{"text": "a"}\n{"id": 1, "text": ' + value + "}\n")
        with pytest.raises(ValueError, match=rf'^{path}:2: "text" is {found}, not a string; write the text as a '
                                             r"JSON string, or choose another field with --text_field \(this line "
                                             r"has: id, text\)$"):
            texts(path)


# -- 9. an unreadable first .jsonl under auto -------------------------------------------------------------------------

def test_unreadable_first_jsonl_is_one_line(tmp_path, monkeypatch):
    """(As root, permissions do not stop a read: the refusal of the open is simulated.)"""
    path = tmp_path / "locked.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    original = io.open

    def refuse(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, os.strerror(13), str(file))
        return original(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", refuse)  # what Path.open calls
    monkeypatch.setattr(builtins, "open", refuse)
    message = rf"^cannot read {path}: Permission denied; check the path and its permissions$"
    with pytest.raises(ValueError, match=message):  # was: PermissionError, a crash's wording
        data_format(SFTSource(train_file=str(path)))
    with pytest.raises(ValueError, match=message):
        list(read_records(path, "chat"))
