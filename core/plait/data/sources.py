"""Where training text comes from, read as a stream of documents in bounded memory.

A *source* is one input file (``.txt``, ``.jsonl``, ``.parquet``) or a local ``datasets`` dir
(``save_to_disk``). ``--train_file`` may name a file, a directory (every ``.txt``/``.jsonl``/``.parquet``
under it, recursively, in sorted order, through symbolic links to directories) or a glob; ``--dataset_name``
names a ``datasets`` dir. A ``.json`` file is refused: it may be one JSON document or JSON lines (``datasets``'
``to_json`` writes lines under that name), and read as text it would train on its syntax.

What a document is:

- ``.txt`` (and any unknown suffix): the whole file is one document, as before (blank lines inside prose
  and verse are formatting, not boundaries). It is read in 1 MiB chunks and handed on in *pieces* of about
  64 Ki characters, each cut right after a newline that sits between two non-space characters (or, in a
  line longer than a piece, before a space between two non-space characters). Byte-level BPE pre-tokenizers
  (GPT-2's and Llama 3's split patterns) never join text across such a point, so the pieces tokenize to
  exactly the ids of the whole file; other tokenizers (e.g. SentencePiece's prefix space) may differ at the
  cuts, once per 64 Ki characters, as when ``run_clm`` tokenizes a text file line by line.
  Newlines are read as Python's universal newlines (``\\r\\n`` and ``\\r`` become ``\\n``).
- ``.jsonl``: one document per line, its ``--text_field`` (default ``text``); blank lines, and lines whose
  field is null, are skipped (as Parquet's null rows). Lines are UTF-8, a BOM at the start allowed
  (``jsonl_lines``, which the SFT readers share).
- Parquet and ``datasets`` dirs: one document per row, the ``--text_field`` column (a string column, also
  dictionary-encoded or string_view, as pandas' categoricals and polars write them); nulls are skipped.

Every reader yields ``(text, ends_document, input_bytes)`` where ``input_bytes`` is how much of the input
the piece stands for (the progress bar's MB/s). A document longer than a piece is cut the same way as a
``.txt`` file, so memory stays bounded whatever the input. Bad input raises ``ValueError`` with one line
naming the file and the byte offset (or line) and the fix.
"""

from __future__ import annotations

import codecs
import glob as globlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

TEXT_SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
READ_CHUNK = 1 << 20  # bytes read from a text file at a time
PIECE_CHARS = 64 * 1024  # characters per piece handed to the tokenizer (a batch holds many pieces)
PARQUET_BATCH_ROWS = 1024

Piece = tuple[str, bool, int]  # (text, ends a document, input bytes it stands for)


def _clip(value: str, width: int = 60) -> str:
    return value if len(value) <= width else value[: width - 3] + "..."


@dataclass(frozen=True)
class Source:
    """One input: ``kind`` is txt, jsonl, parquet or dataset; ``path`` its file (or the datasets dir)."""

    kind: str
    path: Path
    text_field: str = "text"
    split: str | None = None  # the DatasetDict split read (datasets dirs)
    files: tuple[Path, ...] = field(default=())  # the arrow files behind a datasets dir
    flag: str = "--train_file"  # the flag that named it, for messages (not in the cache key)

    def identity(self) -> list:
        """What the cache key holds: the file's absolute path, size and mtime (for a datasets dir, every
        arrow file's), and for formats with fields, the field read. A changed file is a new key."""
        files = self.files or (self.path,)
        stats = []
        for f in files:
            st = f.stat()
            stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return [self.kind, str(self.path.resolve()), stats, None if self.kind == "txt" else self.text_field, self.split]

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in (self.files or (self.path,)))

    def pieces(self) -> Iterator[Piece]:
        if self.kind == "txt":
            return _txt_pieces(self.path)
        if self.kind == "jsonl":
            return _jsonl_pieces(self.path, self.text_field)
        if self.kind == "parquet":
            return _parquet_pieces(self.path, self.text_field)
        return _dataset_pieces(self)


def _file_source(path: Path, text_field: str, flag: str) -> Source:
    """A file named by the user (directly or by a glob): its suffix says how it is read, any unknown one as text
    but ``.json``, whose text is JSON syntax that would be trained on as prose."""
    if path.suffix.lower() == ".json":
        raise ValueError(f"{flag} {path}: .json files are not read (a JSON document is no list of texts, and "
                         f"datasets' to_json writes JSON lines under that name); rename it to .jsonl if it holds one "
                         f"JSON object per line, or to .txt if it is plain text")
    return Source(TEXT_SUFFIXES.get(path.suffix.lower(), "txt"), path, text_field, flag=flag)


def _broken_link(flag: str, path: Path) -> ValueError:
    return ValueError(f"{flag} {path} is a broken symbolic link (to {os.readlink(path)}, which does not exist); "
                      f"fix the link or remove it")


def _data_files(directory: Path, flag: str) -> list[Path]:
    """The non-hidden .txt/.jsonl/.parquet files under ``directory``, sorted by path. Symbolic links to
    directories are followed (a corpus assembled from links is read whole); a broken link, whose data would
    be missing unseen, and a link back into a directory that encloses it, which would never end, are refused
    by name."""
    files: list[Path] = []

    def walk(folder: Path, enclosing: frozenset[Path]) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError as err:
            raise ValueError(f"cannot read the directory {folder}: {err.strerror or err}; check its "
                             f"permissions") from None
        for entry in entries:
            path = Path(entry.path)
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                real = path.resolve()
                if real in enclosing:
                    raise ValueError(f"{flag} {directory}: {path} links back to {real}, a directory that "
                                     f"encloses it, so it would be read without end; remove the link")
                walk(path, enclosing | {real})
            elif entry.is_file():
                if path.suffix.lower() in TEXT_SUFFIXES:
                    files.append(path)
            elif entry.is_symlink():
                raise _broken_link(flag, path)

    walk(directory, frozenset({directory.resolve()}))
    return sorted(files)


def _refuse_repeats(files: list[Path], flag: str, spec: str) -> list[Path]:
    """``files`` if no two of them are one file (a link beside its target, two links to one directory, a hard
    link), which the run would read, and train on, twice; else a refusal naming both paths."""
    seen: dict[tuple[int, int], Path] = {}
    for path in files:
        info = path.stat()
        first = seen.setdefault((info.st_dev, info.st_ino), path)
        if first != path:
            raise ValueError(f"{flag} {spec}: {first} and {path} are one file ({path.resolve()}), which would be read "
                             f"twice; remove one of them (or the link that leads to it)")
    return files


def resolve_sources(spec: str | os.PathLike, text_field: str = "text", flag: str = "--train_file") -> list[Source]:
    """The sources a ``--train_file`` value names: a file, a directory (its .txt/.jsonl/.parquet files,
    recursively through links to directories, sorted) or a glob (sorted matches).

    Raises:
        ValueError: if nothing matches, a directory holds no such file, a link is broken or loops, two paths are
            one file, or a file is a .json file.
    """
    spec = str(spec)
    path = Path(spec)
    if path.is_dir():
        files = _refuse_repeats(_data_files(path, flag), flag, spec)
        if not files:
            raise ValueError(f"{flag} {spec!r} is a directory without .txt, .jsonl or .parquet files; "
                             f"give a file, a glob, or a directory of such files")
        return [_file_source(p, text_field, flag) for p in files]
    if path.exists():
        return [_file_source(path, text_field, flag)]
    if path.is_symlink():
        raise _broken_link(flag, path)
    if globlib.has_magic(spec):
        matches = sorted(Path(p) for p in globlib.glob(spec, recursive=True))
        broken = [p for p in matches if p.is_symlink() and not p.exists()]
        if broken:
            raise _broken_link(flag, broken[0])
        files = _refuse_repeats([p for p in matches if p.is_file()], flag, spec)
        if not files:
            raise ValueError(f"{flag} {spec!r} matches no file; check the pattern (quote it so the shell "
                             f"does not expand it)")
        return [_file_source(p, text_field, flag) for p in files]
    raise ValueError(f"{flag} {spec!r} does not exist")


def dataset_source(dataset_dir: str | os.PathLike, text_field: str = "text") -> Source:
    """A local ``datasets`` dir (``save_to_disk``; its train split if it is a DatasetDict)."""
    data, split = _load_dataset(Path(dataset_dir))
    if text_field not in data.column_names:
        raise ValueError(f"{dataset_dir} has columns {data.column_names}, but no {text_field!r} column; "
                         f"choose one with --text_field")
    files = tuple(Path(f["filename"]) for f in data.cache_files)
    return Source("dataset", Path(dataset_dir), text_field, split, files, "--dataset_name")


def _load_dataset(dataset_dir: Path):
    try:
        import datasets
    except ImportError:
        raise ValueError("--dataset_name needs the `datasets` package: pip install datasets") from None
    try:
        data = datasets.load_from_disk(str(dataset_dir))
    except FileNotFoundError as err:
        raise ValueError(f"--dataset_name {str(dataset_dir)!r} is not a dataset saved with save_to_disk "
                         f"({err})") from None
    split = None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"{dataset_dir} has splits {sorted(data)}, but no 'train' split")
        data, split = data["train"], "train"
    return data, split


def describe(sources: list[Source]) -> str:
    """The sources for a message: one path, or the first and how many more."""
    if len(sources) == 1:
        return str(sources[0].path)
    return f"{sources[0].path} and {len(sources) - 1} more file(s)"


# -- cutting text into pieces ------------------------------------------------------------------------------

def find_cut(text: str, lo: int, hi: int) -> int:
    """A position in ``(lo, hi]`` where ``text`` can be cut without changing byte-level BPE ids: right after
    a newline between two non-space characters, else right before a space between two non-space
    characters; ``hi`` if there is neither. ``text[hi]`` must exist (the character after the cut is known)."""
    pos = text.rfind("\n", lo, hi)
    while pos > lo:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos + 1
        pos = text.rfind("\n", lo, pos)
    pos = text.rfind(" ", lo, hi)
    while pos > lo:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos
        pos = text.rfind(" ", lo, pos)
    return hi


def split_document(text: str, input_bytes: int) -> Iterator[Piece]:
    """One document as pieces of at most about ``PIECE_CHARS`` characters (the last one ends it)."""
    start, n = 0, len(text)
    while n - start > PIECE_CHARS:
        cut = find_cut(text, start + PIECE_CHARS // 2, start + PIECE_CHARS)
        yield text[start:cut], False, input_bytes * (cut - start) // n
        start = cut
    yield text[start:], True, input_bytes - input_bytes * start // n


# -- readers -----------------------------------------------------------------------------------------------

def _open(path: Path):
    try:
        return path.open("rb")
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}; check the path and its permissions") from None


def _binary_error(path: Path, offset: int, what: str) -> ValueError:
    return ValueError(f"{path}: {what} at byte offset {offset:,}; it is not UTF-8 text (give .txt or .jsonl "
                      f"text, or .parquet)")


def _utf8_error(path: Path, offset: int, err: UnicodeDecodeError, where: str = "") -> ValueError:
    """The one line for bytes that are not UTF-8: the file, the line (``where``), the byte and its offset."""
    return ValueError(f"{path}: {where}invalid UTF-8 (byte 0x{err.object[err.start]:02x}: {err.reason}) at byte "
                      f"offset {offset:,}; it is not UTF-8 text: re-encode it (iconv -f ENCODING -t UTF-8), or give "
                      f".parquet")


def _txt_pieces(path: Path) -> Iterator[Piece]:
    """The whole file as one document, in pieces (see the module doc), checked to be UTF-8 text."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    buffer, pending_bytes, offset, any_text = "", 0, 0, False
    carriage = False  # the last chunk ended in "\r": a following "\n" belongs to it
    with _open(path) as f:
        while True:
            try:
                chunk = f.read(READ_CHUNK)
            except OSError as err:
                raise ValueError(f"cannot read {path} at byte offset {offset:,}: {err.strerror or err}") from None
            final = not chunk
            nul = chunk.find(b"\0")
            if nul >= 0:
                raise _binary_error(path, offset + nul, "a NUL byte")
            held = len(decoder.getstate()[0])  # bytes of a character the last chunk ended inside
            try:
                text = decoder.decode(chunk, final)
            except UnicodeDecodeError as err:
                raise _utf8_error(path, offset - held + err.start, err) from None
            offset += len(chunk)
            pending_bytes += len(chunk)
            if carriage and text.startswith("\n"):
                text = text[1:]
            carriage = text.endswith("\r")
            if "\r" in text:
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            buffer += text
            while len(buffer) > PIECE_CHARS:
                cut = find_cut(buffer, PIECE_CHARS // 2, PIECE_CHARS)
                share = pending_bytes * cut // len(buffer)
                yield buffer[:cut], False, share
                any_text = True
                buffer, pending_bytes = buffer[cut:], pending_bytes - share
            if final:
                break
    if buffer or any_text:
        yield buffer, True, pending_bytes


class Line(NamedTuple):
    """A non-blank line of a .jsonl file: its number, the byte offset of its first character, the bytes of the
    file it stands for (newline and a leading BOM included) and its text."""

    number: int
    offset: int
    size: int
    text: str


def _raw_lines(f: IO[bytes], path: Path) -> Iterator[bytes]:
    offset = 0
    while True:
        try:
            raw = f.readline()
        except OSError as err:
            raise ValueError(f"cannot read {path} at byte offset {offset:,}: {err.strerror or err}") from None
        if not raw:
            return
        offset += len(raw)
        yield raw


def jsonl_lines(path: Path) -> Iterator[Line]:
    """The non-blank lines of a .jsonl file, decoded as UTF-8 (a BOM before the first is dropped, as utf-8-sig
    reads it). Text, chat and prompt/completion files are all read through it, so an unreadable, binary or
    non-UTF-8 file is refused in the same words whichever format it was taken for.

    Raises:
        ValueError: naming the file, and the line and byte offset of a NUL byte or of bytes that are not UTF-8.
    """
    offset = 0
    with _open(path) as f:
        for number, raw in enumerate(_raw_lines(f, path), start=1):
            start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
            if b"\0" in raw:
                raise _binary_error(path, start + raw.index(b"\0"), f"line {number}: a NUL byte")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _utf8_error(path, start + err.start, err, f"line {number}: ") from None
            if text.strip():
                yield Line(number, start, offset - start, text)


def _json_value(value: Any) -> str:
    """A JSON value for a message, as its type and (clipped) text: ``a number (5)``, ``null``."""
    if value is None:
        return "null"
    text = _clip(json.dumps(value, ensure_ascii=False), 40)
    if isinstance(value, bool):
        return f"a boolean ({text})"
    if isinstance(value, (int, float)):
        return f"a number ({text})"
    return f"{'a list' if isinstance(value, list) else 'an object'} ({text})"


def _jsonl_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    """One document per line: its ``text_field``; a null field is no text and skipped, as Parquet's nulls are."""
    for line in jsonl_lines(path):
        try:
            record = json.loads(line.text)
        except json.JSONDecodeError as err:
            at = line.offset + len(line.text[:err.pos].encode())
            raise ValueError(f"{path}:{line.number} (byte offset {at:,}): not valid JSON ({err.msg}); "
                             f"each line must be one JSON object") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f'{path}:{line.number}: expected a JSON object with a string "{text_field}" field '
                             f'(found: {_clip(keys)}); choose the field with --text_field')
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise ValueError(f'{path}:{line.number}: "{text_field}" is {_json_value(text)}, not a string; write '
                             f'the text as a JSON string, or choose another field with --text_field (this line '
                             f'has: {_clip(", ".join(map(str, record)))})')
        if text:
            yield from split_document(text, line.size)


def _column_pieces(path: Path, batches, text_field: str, total_rows: int, total_bytes: int) -> Iterator[Piece]:
    """Rows of an Arrow column as documents; ``batches`` yields Arrow arrays of that column."""
    rows = 0
    for array in batches:
        array = _as_strings(array, path, text_field)
        before = total_bytes * rows // max(total_rows, 1)
        rows += len(array)
        budget = total_bytes * rows // max(total_rows, 1) - before
        texts = [t for t in array.to_pylist() if t]
        for i, text in enumerate(texts):
            share = budget // len(texts) + (budget % len(texts) if i == len(texts) - 1 else 0)
            yield from split_document(text, share)


def _as_strings(array: Any, path: Path, text_field: str) -> Any:
    """A text column as an Arrow string array: dictionary-encoded strings (pandas' categoricals, polars'
    Categorical) and string_view columns are text too, cast to strings.

    Raises:
        ValueError: for a column that is not text, naming it, its type and --text_field.
    """
    import pyarrow as pa

    kind = array.type.value_type if pa.types.is_dictionary(array.type) else array.type
    if not any(test(kind) for test in (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)):
        raise ValueError(f"{path}: column {text_field!r} holds {array.type}, not text; choose a text column "
                         f"with --text_field")
    return array if kind == array.type and not pa.types.is_string_view(kind) else array.cast(pa.large_string())


def _unreadable_parquet(path: Path, err: Exception) -> ValueError:
    return ValueError(f"{path}: not a readable Parquet file ({' '.join(str(err).split())}); it may be truncated or "
                      f"not Parquet: write it again")


def _parquet_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:  # a bad footer is an OSError, garbage or a cut file ArrowInvalid
        raise _unreadable_parquet(path, err) from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path} has columns {names}, but no {text_field!r} column; choose one with --text_field")

    def batches() -> Iterator[Any]:
        try:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
                yield batch.column(0)
        except (OSError, pa.ArrowException) as err:  # a row group past an intact footer is corrupt
            raise _unreadable_parquet(path, err) from None

    yield from _column_pieces(path, batches(), text_field, parquet.metadata.num_rows, path.stat().st_size)


def _dataset_pieces(source: Source) -> Iterator[Piece]:
    data, _ = _load_dataset(source.path)
    total = source.size
    if data._indices is None:  # the usual case: the memory-mapped table itself, chunk by chunk
        batches = (chunk for chunk in data.data.table.column(source.text_field).chunks)
    else:
        batches = (batch.column(source.text_field) for batch in data.with_format("arrow").iter(PARQUET_BATCH_ROWS))
    yield from _column_pieces(source.path, batches, source.text_field, data.num_rows, total)


# -- a bounded sample for tokenizer training ---------------------------------------------------------------

def sample_lines(sources: list[Source], budget_chars: int) -> Iterator[str]:
    """Lines of text (with their newlines) from the start of each source, each source's share of
    ``budget_chars`` in proportion to its size: the whole corpus when it is smaller than the budget."""
    total = sum(s.size for s in sources) or 1
    for source in sources:
        share = budget_chars if total <= budget_chars else max(budget_chars * source.size // total, 1)
        taken = 0
        for text, _, _ in source.pieces():
            for line in text.splitlines(keepends=True):
                yield line
                taken += len(line)
                if taken >= share and total > budget_chars:
                    break
            if taken >= share and total > budget_chars:
                break
