"""Packed token blocks for a model of a given vocabulary size.

A tokenizer sized to the model (the model dir's own, or a BPE trained on the text) when the vocabulary
can hold one; raw bytes folded into the vocabulary otherwise (tiny test models of a few dozen tokens).

:class:`TokenBlocks` reads blocks from a token cache file (``plait.data.cache``): what training uses.
:func:`training_blocks` is the former in-memory path (the whole corpus tokenized into one tensor), kept as
the reference the cache is tested against and that ``bench/data.py`` compares with.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from plait.data.cache import default_cache_root, short_stream_error
from plait.data.dataset import pack_blocks, tokenize_files
from plait.data.documents import read_documents
from plait.data.tokenizer import MIN_VOCAB_SIZE, load_or_train_tokenizer


def default_cache_dir() -> Path:
    return default_cache_root()


def byte_token_ids(files: list[Path], vocab_size: int) -> torch.LongTensor:
    """Every byte of every document as one id, folded into ``vocab_size`` (for vocabularies under 257)."""
    data = b"".join(doc.encode("utf-8") for path in files for doc in read_documents(path))
    if not data:
        raise ValueError(f"no text in {', '.join(map(str, files))}: the file is empty; give a .txt or .jsonl with text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() % vocab_size


def training_blocks(
    files: list[Path], block_size: int, vocab_size: int, tokenizer_dir: Path | None = None,
    cache_dir: Path | None = None,
) -> tuple[torch.LongTensor, PreTrainedTokenizerBase | None]:
    """[num_blocks, block_size] token ids and the tokenizer that made them (None for bytes)."""
    if tokenizer_dir is None and vocab_size < MIN_VOCAB_SIZE:
        return pack_blocks(byte_token_ids(files, vocab_size), block_size), None
    tokenizer = load_or_train_tokenizer(tokenizer_dir, files, vocab_size,
                                        cache_dir or default_cache_dir() / "tokenizers")
    return pack_blocks(tokenize_files(files, tokenizer), block_size), tokenizer


class _FileHandle:
    """A read-only descriptor opened on first use (again in a forked child), closed with the last view."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid: int | None = None

    def fd(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass

    def __getstate__(self) -> dict:
        return {"path": self.path, "_fd": None, "_pid": None}


class TokenBlocks:
    """``[num_blocks, block_size]`` token ids read from a flat token file, a block at a time.

    Block ``i`` is tokens ``[i * block_size, (i + 1) * block_size)`` of the file (the remainder is dropped),
    so the blocks equal ``pack_blocks`` of the same stream. Indexing with a tensor (or list) of block indices
    returns an int64 tensor holding only those rows, read with ``pread``: a rank reads the blocks of its own
    micro-batches, and its resident memory does not grow as an epoch touches every block (the page cache
    keeps the file once per machine). A slice returns a view of the same kind (``blocks[:n][rank::dp]``);
    an int returns one row; ``.to(device)`` and ``tensor()`` read all rows of a view.
    """

    def __init__(self, path: str | os.PathLike, dtype: np.dtype | str, block_size: int, rows: range | None = None,
                 num_tokens: int | None = None, handle: _FileHandle | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.path = Path(path)
        self.token_dtype = np.dtype(dtype).newbyteorder("<")
        self.block_size = block_size
        if num_tokens is None:
            num_tokens = self.path.stat().st_size // self.token_dtype.itemsize
        self.num_tokens = num_tokens
        num_blocks = num_tokens // block_size
        if rows is None:
            if num_blocks < 1:
                raise short_stream_error(self.path, num_tokens, block_size)
            rows = range(num_blocks)
        self.rows = rows
        self._row_bytes = block_size * self.token_dtype.itemsize
        self._handle = handle or _FileHandle(self.path)  # shared by views of the same file

    # the tensor-like surface the trainer uses
    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), self.block_size))

    dtype = torch.long

    def __len__(self) -> int:
        return len(self.rows)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, key):
        if isinstance(key, slice):
            return TokenBlocks(self.path, self.token_dtype, self.block_size, self.rows[key], self.num_tokens,
                               self._handle)
        if isinstance(key, (int, np.integer)) or (torch.is_tensor(key) and key.dim() == 0):
            return self._read(np.array([self.rows[int(key)]], dtype=np.int64))[0]
        return self._read(self._physical(key))

    def read_spans(self, key, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Blocks ``key`` (a tensor or list of block indices) with only the token ranges ``spans`` of each read,
        zeros elsewhere: a context-parallel rank reads its slice of each block (and the tokens its labels need),
        not the whole block."""
        return self._read(self._physical(key), spans)

    def _physical(self, key) -> np.ndarray:
        """Rows of the file for block indices ``key`` of this view (negative indices count from the end)."""
        index = key.numpy() if torch.is_tensor(key) else np.asarray(key)
        if index.dtype == bool:
            raise TypeError("TokenBlocks does not support boolean masks; index with block indices")
        index = index.astype(np.int64, copy=False).reshape(-1)
        n = len(self.rows)
        if index.size and (index.min() < -n or index.max() >= n):
            raise IndexError(f"block index out of range for {n} blocks")
        index = np.where(index < 0, index + n, index)
        return self.rows.start + self.rows.step * index

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.tensor().to(*args, **kwargs)

    def tensor(self) -> torch.Tensor:
        """Every row of this view as one int64 tensor."""
        return self[np.arange(len(self.rows))]

    def __iter__(self):
        for i in range(len(self.rows)):
            yield self[i]

    def __repr__(self) -> str:
        return (f"TokenBlocks({self.path}, {len(self.rows):,} blocks of {self.block_size}, "
                f"{self.token_dtype.name})")

    def _read(self, physical: np.ndarray, spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        spans = spans or [(0, self.block_size)]
        out = np.zeros((len(physical), self.block_size), dtype=self.token_dtype)
        size = self.token_dtype.itemsize
        if hasattr(os, "preadv"):
            fd = self._handle.fd()
            for i, row in enumerate(physical.tolist()):
                for a, b in spans:
                    got = os.preadv(fd, [out[i, a:b]], row * self._row_bytes + a * size)
                    if got != (b - a) * size:
                        raise OSError(f"{self.path}: read {got} of {(b - a) * size} bytes of block {row} "
                                      f"(truncated?)")
        else:  # a fresh map per read, so pages do not pile up in this process
            tokens = np.memmap(self.path, dtype=self.token_dtype, mode="r")
            whole = tokens[: len(tokens) // self.block_size * self.block_size].reshape(-1, self.block_size)
            for a, b in spans:
                out[:, a:b] = whole[physical, a:b]
            del tokens, whole
        return torch.from_numpy(out.astype(np.int64))
