"""Where training text comes from, read as a stream of documents in bounded memory.

A *source* is one input file (``.txt``, ``.jsonl``, ``.parquet``) or a local ``datasets`` dir
(``save_to_disk``). ``--train_file`` may name a file, a directory (every ``.txt``/``.jsonl``/``.parquet``
under it, recursively, in sorted order) or a glob; ``--dataset_name`` names a ``datasets`` dir.

What a document is:

- ``.txt`` (and any unknown suffix): the whole file is one document, as before (blank lines inside prose
  and verse are formatting, not boundaries). It is read in 1 MiB chunks and handed on in *pieces* of about
  64 Ki characters, each cut right after a newline that sits between two non-space characters (or, in a
  line longer than a piece, before a space between two non-space characters). Byte-level BPE pre-tokenizers
  (GPT-2's and Llama 3's split patterns) never join text across such a point, so the pieces tokenize to
  exactly the ids of the whole file; other tokenizers (e.g. SentencePiece's prefix space) may differ at the
  cuts, once per 64 Ki characters, as when ``run_clm`` tokenizes a text file line by line.
  Newlines are read as Python's universal newlines (``\\r\\n`` and ``\\r`` become ``\\n``).
- ``.jsonl``: one document per line, its ``--text_field`` (default ``text``); blank lines are skipped.
- Parquet and ``datasets`` dirs: one document per row, the ``--text_field`` column; nulls are skipped.

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


def _file_source(path: Path, text_field: str) -> Source:
    return Source(TEXT_SUFFIXES.get(path.suffix.lower(), "txt"), path, text_field)


def resolve_sources(spec: str | os.PathLike, text_field: str = "text", flag: str = "--train_file") -> list[Source]:
    """The sources a ``--train_file`` value names: a file, a directory (its .txt/.jsonl/.parquet files,
    recursively, sorted) or a glob (sorted matches).

    Raises:
        ValueError: if nothing matches or a directory holds no such file.
    """
    spec = str(spec)
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"{flag} {spec!r} is a directory without .txt, .jsonl or .parquet files; "
                             f"give a file, a glob, or a directory of such files")
        return [_file_source(p, text_field) for p in files]
    if path.exists():
        return [_file_source(path, text_field)]
    if globlib.has_magic(spec):
        files = sorted(Path(p) for p in globlib.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise ValueError(f"{flag} {spec!r} matches no file; check the pattern (quote it so the shell "
                             f"does not expand it)")
        return [_file_source(p, text_field) for p in files]
    raise ValueError(f"{flag} {spec!r} does not exist")


def dataset_source(dataset_dir: str | os.PathLike, text_field: str = "text") -> Source:
    """A local ``datasets`` dir (``save_to_disk``; its train split if it is a DatasetDict)."""
    data, split = _load_dataset(Path(dataset_dir))
    if text_field not in data.column_names:
        raise ValueError(f"{dataset_dir} has columns {data.column_names}, but no {text_field!r} column; "
                         f"choose one with --text_field")
    files = tuple(Path(f["filename"]) for f in data.cache_files)
    return Source("dataset", Path(dataset_dir), text_field, split, files)


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
            try:
                text = decoder.decode(chunk, final)
            except UnicodeDecodeError as err:
                raise _binary_error(path, offset + err.start, f"invalid UTF-8 ({err.reason})") from None
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


def _jsonl_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    offset = 0
    with _open(path) as f:
        for line_no, line in enumerate(f, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            if b"\0" in line:
                raise _binary_error(path, start + line.index(b"\0"), f"line {line_no}: a NUL byte")
            try:
                record = json.loads(line)
            except UnicodeDecodeError as err:
                raise _binary_error(path, start + err.start, f"line {line_no}: invalid UTF-8") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} (byte offset {start + err.pos:,}): not valid JSON ({err.msg}); "
                                 f"each line must be one JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f'{path}:{line_no}: expected a JSON object with a string "{text_field}" field '
                                 f'(found: {_clip(keys)}); choose the field with --text_field')
            text = record[text_field]
            if text:
                yield from split_document(text, len(line))


def _column_pieces(path: Path, batches, text_field: str, total_rows: int, total_bytes: int) -> Iterator[Piece]:
    """Rows of an Arrow column as documents; ``batches`` yields Arrow arrays of that column."""
    import pyarrow as pa

    rows = 0
    for array in batches:
        if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
            raise ValueError(f"{path}: column {text_field!r} holds {array.type}, not text; choose a text column "
                             f"with --text_field")
        before = total_bytes * rows // max(total_rows, 1)
        rows += len(array)
        budget = total_bytes * rows // max(total_rows, 1) - before
        texts = [t for t in array.to_pylist() if t]
        for i, text in enumerate(texts):
            share = budget // len(texts) + (budget % len(texts) if i == len(texts) - 1 else 0)
            yield from split_document(text, share)


def _parquet_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(path)
    except OSError as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ValueError(f"{path} has columns {names}, but no {text_field!r} column; choose one with --text_field")
    batches = (b.column(0) for b in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]))
    yield from _column_pieces(path, batches, text_field, parquet.metadata.num_rows, path.stat().st_size)


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
