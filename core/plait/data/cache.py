"""Tokenize once, cache on disk: token ids as a flat array file plus an index of document ends.

One cache entry is a directory ``<root>/tokens/<first file's name>-<key>/`` holding

- ``tokens.bin``: every token id of the corpus, little-endian ``uint16`` when the ids fit (vocabulary of
  at most 65,536), else ``uint32``; documents in input order, each followed by the tokenizer's eos (as
  Hugging Face's ``run_clm`` packs text; byte ids have no eos and are concatenated as before). It is
  exactly what ``numpy.memmap(path, dtype)`` reads, nanoGPT's format;
- ``docs.bin``: ``uint64`` end offset (in tokens, after the eos) of every document;
- ``meta.json``: counts, dtype, and the key's contents.

The key hashes the format version, every input file's absolute path, size and mtime (for a ``datasets``
dir, those of its arrow files), the text field, and the tokenizer's content (its ``tokenizer.json``
serialisation, or the byte fold ``bytes % vocab_size``): a changed file or tokenizer is another entry, and
nothing stale is read. ``block_size`` is not in the key: blocks are cut from the stream when read, so any
block size reuses the entry.

An entry is written to ``.<name>.tmp-<host>-<pid>/`` and renamed into place when complete, so a directory
with the final name is complete (its ``meta.json`` and file sizes are checked again on open; an entry that
fails the check is ignored and rebuilt). A preparation that fails removes its temporary directory; one that
is killed leaves a ``.tmp`` directory that the next preparation of the same key removes.

Only one process per key prepares: the first to take ``.<name>.lock`` (``flock``), normally local rank 0;
it touches ``.<name>.busy`` every second while it works. Other processes (other local ranks, another node on
a shared file system) poll for the finished entry, never a collective, and give up with a one-line error
naming the entry and the fix when the preparing process has shown no sign of life for ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from plait.data.sources import Source, describe

FORMAT = "plait-tokens-v1"
TOKENS_FILE, DOCS_FILE, META_FILE = "tokens.bin", "docs.bin", "meta.json"
BATCH_CHARS = 4 << 20  # characters encoded per tokenizer call: parallel over its pieces, bounded memory
HEARTBEAT_S = 1.0


class CacheTimeout(ValueError):
    """A process waited ``timeout`` seconds for another one's preparation with no sign of progress."""


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/plait``, else ``~/.cache/plait``: shared by every run of this user on this machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plait"


def token_dtype(num_ids: int) -> np.dtype:
    """The smallest unsigned dtype holding ids ``0 .. num_ids - 1``."""
    return np.dtype(np.uint16) if num_ids <= 1 << 16 else np.dtype(np.uint32)


# -- encoders: text pieces -> id arrays --------------------------------------------------------------------

class ByteEncoder:
    """Every UTF-8 byte as one id, folded into ``vocab_size`` (models too small for a BPE)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos = None
        self.dtype = token_dtype(vocab_size)
        self.key = f"bytes%{vocab_size}"
        self.name = f"UTF-8 bytes mod {vocab_size}"

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            out.append((ids % self.vocab_size if self.vocab_size < 256 else ids).astype(self.dtype))
        return out


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the ids: the backend's full serialisation (normaliser, pre-tokenizer, model,
    added tokens), the eos id, and for a slow tokenizer its vocabulary file."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
        digest.update(str(getattr(tokenizer, "split_special_tokens", False)).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        vocab_file = getattr(tokenizer, "vocab_file", None)
        if vocab_file and Path(vocab_file).is_file():
            digest.update(Path(vocab_file).read_bytes())
    digest.update(str(tokenizer.eos_token_id).encode())
    return digest.hexdigest()[:24]


class TokenizerEncoder:
    """A transformers tokenizer without special tokens, through its Rust backend's batch encoding (all cores)
    when it has one."""

    def __init__(self, tokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token to separate documents; give a tokenizer with an "
                             "eos_token (--tokenizer_name)")
        self.tokenizer = tokenizer
        self.eos = int(tokenizer.eos_token_id)
        self.dtype = token_dtype(len(tokenizer))
        self.key = f"tokenizer:{tokenizer_fingerprint(tokenizer)}"
        self.name = f"{type(tokenizer).__name__} ({len(tokenizer):,} tokens)"
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())  # a copy: no truncation or padding, nothing shared
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self.backend = backend

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.backend is not None:
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [np.array(e.ids, dtype=self.dtype) for e in encode(texts, add_special_tokens=False)]
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [np.array(x, dtype=self.dtype) for x in ids]


# -- one-writer-many-readers protocol ----------------------------------------------------------------------

def _host() -> str:
    return socket.gethostname().replace("-", "_")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_temporaries(final: Path) -> Iterator[Path]:
    """Temporary dirs of ``final`` left by dead processes of this host."""
    prefix = f".{final.name}.tmp-{_host()}-"
    for path in final.parent.glob(f".{final.name}.tmp-*"):
        pid = path.name[len(prefix):] if path.name.startswith(prefix) else ""
        if pid.isdigit() and not _alive(int(pid)):
            yield path


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _busy_path(final: Path) -> Path:
    return final.parent / f".{final.name}.busy"


def _check_stall(final: Path, since: float, timeout: float, what: str) -> None:
    busy = _busy_path(final)
    try:
        last = max(since, busy.stat().st_mtime)
    except FileNotFoundError:
        last = since
    if time.time() - last > timeout:
        raise CacheTimeout(
            f"waited {timeout:g} s for {what} {final} with no sign of progress from the process preparing it "
            f"(local rank 0): it failed (see its error) or is stuck; prepare it first with `plait prepare-data` "
            f"and the same data flags, or raise --ddp_timeout")


def wait_for(final: Path, is_complete: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll until ``is_complete()``; raise ``CacheTimeout`` once the preparer has been silent ``timeout`` s."""
    since, delay = time.time(), 0.05
    while not is_complete():
        _check_stall(final, since, timeout, what)
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


@contextlib.contextmanager
def exclusive(final: Path, is_complete: Callable[[], bool], timeout: float, what: str) -> Iterator[bool]:
    """Take the preparation lock of ``final``; yield True if this process must prepare it, False if another
    one finished it meanwhile. While held, a heartbeat touches the busy file for the waiters."""
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    since, delay = time.time(), 0.05
    with open(lock_path, "a+b") as lock:
        while True:
            if is_complete():
                yield False
                _remove(lock_path)  # nobody needs it once the entry is complete
                return
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            _check_stall(final, since, timeout, what)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        busy = _busy_path(final)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(max(min(HEARTBEAT_S, timeout / 4), 0.05)):
                with contextlib.suppress(OSError):
                    os.utime(busy)

        busy.touch()
        thread = threading.Thread(target=beat, name="plait-cache-heartbeat", daemon=True)
        thread.start()
        try:
            yield not is_complete()
        finally:
            stop.set()
            thread.join()
            _remove(busy)
            _remove(lock_path)  # a process still waiting on the old inode re-checks completeness first
            fcntl.flock(lock, fcntl.LOCK_UN)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary dir into place (an identical entry already there wins)."""
    try:
        os.rename(tmp, final)
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# -- the token cache ---------------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(entry: Path) -> dict | None:
    """The entry's metadata if the entry is complete: meta.json present and both files of the recorded size."""
    try:
        meta = json.loads((entry / META_FILE).read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        if meta.get("format") != FORMAT:
            return None
        if (entry / TOKENS_FILE).stat().st_size != meta["num_tokens"] * itemsize:
            return None
        if (entry / DOCS_FILE).stat().st_size != meta["num_documents"] * 8:
            return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


class CacheEntry:
    """One cache entry under ``root``/``kind``, named by a digest of ``key_fields``: local rank 0 writes it in a
    temporary directory (``_write`` returns its metadata) and renames it into place; other ranks wait for it.
    Subclasses say what a complete entry is (``read_meta``) and how to write one (``_write``)."""

    kind = ""
    what = ""

    def __init__(self, root: Path, sources: list[Source], key_fields: dict) -> None:
        self.root, self.sources, self.key_fields = Path(root), sources, key_fields
        digest = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
        stem = "".join(c if c.isalnum() or c in "._" else "_" for c in sources[0].path.name)[:40]
        self.path = self.root / self.kind / f"{stem}-{digest}"

    def read_meta(self) -> dict | None:
        raise NotImplementedError

    def _write(self, tmp: Path, **options) -> dict:
        raise NotImplementedError

    @property
    def meta(self) -> dict | None:
        return self.read_meta()

    def is_complete(self) -> bool:
        return self.meta is not None

    def ensure(self, local_rank: int = 0, timeout: float = 600.0, **options) -> tuple[dict, bool]:
        """The entry's metadata, preparing it first on local rank 0 if needed (other ranks wait for it).
        Returns (meta, prepared_here)."""
        meta = self.meta
        if meta is not None:
            return meta, False
        if local_rank != 0:
            wait_for(self.path, self.is_complete, timeout, self.what)
            return self.meta, False
        with exclusive(self.path, self.is_complete, timeout, self.what) as mine:
            if mine:
                self._prepare(**options)
        return self.meta, mine

    def _prepare(self, **options) -> None:
        for stale in _stale_temporaries(self.path):
            shutil.rmtree(stale, ignore_errors=True)
        if self.path.exists():  # a directory that failed the completeness check: never read, rebuilt
            shutil.rmtree(self.path)
        tmp = self.path.parent / f".{self.path.name}.tmp-{_host()}-{os.getpid()}"
        _remove(tmp)
        tmp.mkdir(parents=True)
        try:
            meta = self._write(tmp, **options)
            for written in tmp.iterdir():
                _fsync(written)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
            _fsync(tmp / META_FILE)
            publish(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


class TokenCache(CacheEntry):
    """The cache entry of ``sources`` tokenized by ``encoder`` under ``root``."""

    kind, what = "tokens", "the tokenized data"

    def __init__(self, root: Path, sources: list[Source], encoder) -> None:
        self.encoder = encoder
        super().__init__(root, sources, {"format": FORMAT, "sources": [s.identity() for s in sources],
                                         "encoder": encoder.key, "eos_between_documents": encoder.eos})

    def read_meta(self) -> dict | None:
        return read_meta(self.path)

    def _write(self, tmp: Path, progress: bool = True) -> dict:
        encoder, dtype = self.encoder, self.encoder.dtype
        eos = None if encoder.eos is None else np.array([encoder.eos], dtype=dtype)
        counts = {"tokens": 0, "documents": 0}
        start = time.perf_counter()
        before = [s.identity() for s in self.sources]
        total_bytes = sum(s.size for s in self.sources)
        with open(tmp / TOKENS_FILE, "wb") as tokens_f, open(tmp / DOCS_FILE, "wb") as docs_f, \
                _progress_bar(progress, total_bytes, _short(self.sources)) as advance:
            texts: list[str] = []
            ends: list[bool] = []
            state = {"chars": 0, "bytes": 0}

            def flush() -> None:
                parts, doc_ends = [], []
                for ids, ends_document in zip(encoder.encode(texts), ends):
                    parts.append(ids)
                    counts["tokens"] += len(ids)
                    if ends_document:
                        if eos is not None:
                            parts.append(eos)
                            counts["tokens"] += 1
                        doc_ends.append(counts["tokens"])
                if parts:
                    tokens_f.write(np.concatenate(parts).astype("<" + dtype.str[1:], copy=False).tobytes())
                if doc_ends:
                    docs_f.write(np.asarray(doc_ends, dtype="<u8").tobytes())
                    counts["documents"] += len(doc_ends)
                advance(state["bytes"])
                texts.clear()
                ends.clear()
                state.update(chars=0, bytes=0)

            for source in self.sources:
                for text, ends_document, nbytes in source.pieces():
                    texts.append(text)
                    ends.append(ends_document)
                    state["chars"] += len(text)
                    state["bytes"] += nbytes
                    if state["chars"] >= BATCH_CHARS:
                        flush()
            flush()
        seconds = time.perf_counter() - start
        if counts["documents"] == 0:
            raise ValueError(empty_message(self.sources))
        for source, identity in zip(self.sources, before):
            if source.identity() != identity:
                raise ValueError(f"{source.path} changed while it was being tokenized; run again once it is "
                                 f"completely written")
        return {"format": FORMAT, "dtype": dtype.name, "num_tokens": counts["tokens"],
                "num_documents": counts["documents"], "input_bytes": total_bytes, "seconds": round(seconds, 3),
                "eos": encoder.eos, "encoder": encoder.name, "key": self.key_fields,
                "inputs": f"{self.sources[0].flag} {describe(self.sources)}",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def tokens(self) -> np.memmap:
        """The whole token stream, memory-mapped read-only."""
        meta = self.meta
        if meta is None:
            raise ValueError(f"{self.path} is not a complete token cache")
        if meta["num_tokens"] == 0:
            return np.zeros(0, dtype=meta["dtype"])
        return np.memmap(self.path / TOKENS_FILE, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")

    def document_ends(self) -> np.memmap:
        meta = self.meta
        if meta is None or meta["num_documents"] == 0:
            return np.zeros(0, dtype="<u8")
        return np.memmap(self.path / DOCS_FILE, dtype="<u8", mode="r")


def short_stream_error(tokens_file: Path, num_tokens: int, block_size: int) -> ValueError:
    """The one line for a token stream shorter than one block: whose data (the flag and files, from the entry's
    meta.json), how many tokens, and the fix. The entry itself is removed, so the failed preparation leaves
    none: ``block_size`` is not in the key, but an entry of fewer tokens than a block is tokenized again in no
    time should a smaller block size want it."""
    meta = read_meta(tokens_file.parent) if tokens_file.name == TOKENS_FILE else None
    inputs = meta.get("inputs", str(tokens_file)) if meta is not None else str(tokens_file)
    if meta is not None:
        shutil.rmtree(tokens_file.parent, ignore_errors=True)
    fix = f"use --block_size {num_tokens} or less, or give more data" if num_tokens >= 2 else "give more data"
    return ValueError(f"{inputs}: {num_tokens:,} tokens are fewer than one block of --block_size={block_size}; {fix}")


def _short(sources: list[Source]) -> str:
    name = sources[0].path.name
    return name if len(sources) == 1 else f"{name} +{len(sources) - 1} files"


def empty_message(sources: list[Source]) -> str:
    names = ", ".join(str(s.path) for s in sources[:5]) + (f" and {len(sources) - 5} more" if len(sources) > 5 else "")
    what = "the file is empty" if len(sources) == 1 else "the files hold no text"
    return f"no text in {names}: {what}; give a .txt, .jsonl or .parquet file with text"


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (bytes, MB/s, time left); ``advance(n)`` moves it by n input bytes."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("tokenizing {task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=False)
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)
        progress.update(task, completed=total)
