"""Reading slices of safetensors files without mapping them, and writing them one tensor at a time.

Why not ``safetensors.safe_open(...).get_slice``: it reads through an mmap, and every file page it touches
counts in the process RSS; a column slice of a row-major tensor touches every page, so a rank loading half of
a 1 GiB file peaked at +1.5 GiB (docs/decisions.md D6). Parsing the header and ``os.preadv``-ing only the bytes of
a slice straight into the destination tensor peaks at the slice itself.

Why not ``safetensors.torch.save_file`` for writing: it needs every tensor of a file in memory at once, while
``plait consolidate`` assembles one tensor (or one chunk of rows) at a time; the header is known in advance
(names, dtypes, shapes), so the file can be written header first and then tensor by tensor at known offsets.
The files are plain safetensors: ``safe_open`` and ``from_pretrained`` read them (tests check both).
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

# safetensors dtype names <-> torch dtypes (the subset torch can hold).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
CHECKSUM = "xxh3_64"  # the name of ``checksum`` in checkpoint indexes
CHUNK_BYTES = 16 * 1024 * 1024  # bound on temporary buffers while reading or assembling
MIN_RUN_BYTES = 64 * 1024  # below this, one preadv per run costs more than reading whole rows
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# Linux's uncached buffered writes (RWF_DONTCACHE, kernel 6.14+): the pages of a write leave the page cache once the
# kernel has written them back. A checkpoint's hundreds of MB otherwise stay in the cache, dirty and then clean,
# crowding the training beside them: with --save_async (bench/async_save.py, a save of 0.35 GB every 2 steps) the
# run took 1.08-1.12x the time of one without saves, and 1.04-1.05x with the flag. Where the kernel or file system
# refuses the flag, writes fall back to plain ones (``UNCACHED`` turns False at the first refusal).
RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)
UNCACHED = hasattr(os, "pwritev") and os.uname().sysname == "Linux"


class SafetensorsError(ValueError):
    """A file that is not a valid, complete safetensors file; the message names the file and the problem."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class SafetensorsFile:
    """The parsed header of one safetensors file; reads byte ranges with ``os.preadv`` (no mmap)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{self.path}: {size} bytes is too short for a safetensors header")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > min(size - 8, 100 * 1024 * 1024):
                    raise SafetensorsError(f"{self.path}: header length {header_len} exceeds the file size {size}")
                raw = f.read(header_len)
        except FileNotFoundError:
            raise SafetensorsError(f"{self.path}: file is missing") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{self.path}: header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        self.entries: dict[str, Entry] = {}
        end = 0
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, stop = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: header entry {name!r} is malformed: {info!r}") from None
            expected = math.prod(shape) * _itemsize(dtype)
            if stop - begin != expected:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} {info['dtype']}{list(shape)} needs {expected} bytes, "
                    f"header gives {stop - begin}"
                )
            self.entries[name] = Entry(dtype, shape, data_start + begin, data_start + stop)
            end = max(end, stop)
        if data_start + end != size:
            raise SafetensorsError(
                f"{self.path}: file has {size} bytes but its header describes {data_start + end} "
                f"(truncated or appended to)"
            )

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise SafetensorsError(f"{self.path}: has no tensor {name!r}") from None

    def read_box(self, name: str, box: Sequence[tuple[int, int]], out: torch.Tensor) -> None:
        """Copy ``stored[box]`` (one (start, stop) per dim) of tensor ``name`` into ``out`` (any dtype/view)."""
        entry = self.entry(name)
        shape = entry.shape
        sizes = [b - a for a, b in box]
        if tuple(out.shape) != tuple(sizes) or len(box) != len(shape):
            raise ValueError(f"{self.path}:{name}: box {list(box)} of {list(shape)} does not fit out {list(out.shape)}")
        if out.numel() == 0:
            return
        if not shape:  # 0-d
            self._read_into(entry.start, entry.nbytes, out, entry.dtype)
            return
        item = _itemsize(entry.dtype)
        row_elems = math.prod(shape[1:])
        row_bytes = row_elems * item
        full_rows = all(box[d] == (0, shape[d]) for d in range(1, len(shape)))
        (r_begin, r_end) = box[0]
        rows_per_chunk = max(1, CHUNK_BYTES // max(row_bytes, 1))
        with open(self.path, "rb", buffering=0) as f:
            fd = f.fileno()
            if not full_rows and len(shape) == 2 and out.is_contiguous() and out.dtype == entry.dtype \
                    and sizes[1] * item >= MIN_RUN_BYTES:
                # Long runs: one read per row, straight into the destination.
                views = byte_view(out)
                run = sizes[1] * item
                for i, r in enumerate(range(r_begin, r_end)):
                    _pread(fd, views[i * run:(i + 1) * run], entry.start + r * row_bytes + box[1][0] * item, self.path)
                return
            for c0 in range(r_begin, r_end, rows_per_chunk):
                c1 = min(c0 + rows_per_chunk, r_end)
                dest = out[c0 - r_begin: c1 - r_begin]
                offset = entry.start + c0 * row_bytes
                if full_rows:
                    self._read_into(offset, (c1 - c0) * row_bytes, dest, entry.dtype, fd)
                else:
                    rows = torch.empty((c1 - c0, *shape[1:]), dtype=entry.dtype)
                    _pread(fd, byte_view(rows), offset, self.path)
                    dest.copy_(rows[(slice(None), *(slice(a, b) for a, b in box[1:]))])

    def _read_into(
        self, offset: int, nbytes: int, out: torch.Tensor, dtype: torch.dtype, fd: int | None = None
    ) -> None:
        """Read ``nbytes`` at ``offset`` into ``out`` (directly when layout and dtype allow)."""
        direct = out.is_contiguous() and out.dtype == dtype
        target = out if direct else torch.empty(out.shape, dtype=dtype)
        if fd is None:
            with open(self.path, "rb", buffering=0) as f:
                _pread(f.fileno(), byte_view(target), offset, self.path)
        else:
            _pread(fd, byte_view(target), offset, self.path)
        if not direct:
            out.copy_(target)

    def read_scatter(self, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order from the contiguous file bytes at absolute ``offset`` (``preadv`` scatters one
        run of the file into many buffers: e.g. rows of a column band, each into its place in a wider row)."""
        with open(self.path, "rb", buffering=0) as f:
            for i in range(0, len(views), IOV_MAX):
                group = views[i:i + IOV_MAX]
                expected = sum(len(v) for v in group)
                done = os.preadv(f.fileno(), group, offset)
                if done < expected:  # a short read: finish view by view (and fail clearly at end of file)
                    for view in group:
                        skip = min(done, len(view))
                        _pread(f.fileno(), view[skip:], offset + skip, self.path)
                        done -= skip
                        offset += len(view)
                else:
                    offset += expected

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (a fresh CPU tensor)."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_box(name, [(0, s) for s in entry.shape], out)
        return out

    def checksum(self, name: str) -> int:
        """``checksum`` of the stored bytes of ``name`` (integrity check against the index).

        Read through read-only mmap windows of at most CHUNK_BYTES, unmapped one after the other: no copy
        into a buffer (5x less CPU than ``pread`` here) and never more than one window in the RSS.
        """
        entry = self.entry(name)
        digest = xxhash.xxh3_64()
        with open(self.path, "rb", buffering=0) as f:
            pos = entry.start
            while pos < entry.stop:
                base = pos - pos % mmap.ALLOCATIONGRANULARITY
                length = min(CHUNK_BYTES, entry.stop - base)
                try:
                    window = mmap.mmap(f.fileno(), length, offset=base, access=mmap.ACCESS_READ)
                except ValueError as exc:  # the file is shorter than the header says
                    raise SafetensorsError(f"{self.path}: cannot read bytes {base}-{base + length} ({exc})") from None
                with window, memoryview(window) as whole, whole[pos - base:] as part:
                    digest.update(part)
                pos = base + length
        return digest.intdigest()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _pread(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from ``offset``; a short read means the file is shorter than its header says."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise SafetensorsError(f"{path}: unexpected end of file at byte {offset + done} (truncated?)")
        done += n


def pwrite_uncached(fd: int, data: memoryview, offset: int) -> int:
    """``os.pwrite``, uncached where the kernel and file system take ``RWF_DONTCACHE``; the bytes written."""
    global UNCACHED
    if UNCACHED:
        try:
            return os.pwritev(fd, [data], offset, RWF_DONTCACHE)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            UNCACHED = False
    return os.pwrite(fd, data, offset)


def checksum(data: memoryview | bytes) -> int:
    """xxHash3 (64 bit) of ``data``: the per-tensor integrity check of plait checkpoints. CRC-32 (zlib) ran at
    1.5 GB/s here, xxh3 at 9 GB/s, which keeps verification from dominating ``plait consolidate``."""
    return xxhash.xxh3_64_intdigest(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Read-only byte view of a tensor's data (made contiguous on CPU if needed) for writing and checksums."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return byte_view(t.contiguous())


class SafetensorsWriter:
    """Writes a safetensors file whose tensor list is known up front, one tensor (or part) at a time, from
    any number of threads (every write goes to an absolute offset).

    The file is written as ``<name>.partial`` and moved into place by ``close`` once every byte has been
    written and synced, so a reader never sees a half-written file under the final name.
    """

    def __init__(
        self, path: str | os.PathLike, tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.offsets[name] = (pos, pos + nbytes)
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + pos
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._pwrite(struct.pack("<Q", len(raw)) + raw, 0)
        except BaseException:
            self.abort()
            raise
        self._written = 0  # tensor bytes written so far (the header is not counted)
        self._lock = threading.Lock()  # write / copy_from may be called from several threads

    def tensor_offset(self, name: str) -> int:
        """Absolute file offset of tensor ``name``'s first byte."""
        return self.data_start + self.offsets[name][0]

    def write(self, name: str, data: memoryview | bytes, at: int = 0) -> None:
        """Write ``data`` at byte ``at`` inside tensor ``name``."""
        begin, end = self.offsets[name]
        if at + len(data) > end - begin:
            raise ValueError(f"{self.path}: {len(data)} bytes at {at} overflow tensor {name!r} ({end - begin} bytes)")
        self._pwrite(data, self.data_start + begin + at)
        with self._lock:
            self._written += len(data)

    def copy_from(self, src_fd: int, src_offset: int, nbytes: int, name: str, at: int = 0) -> None:
        """Copy ``nbytes`` from another file into tensor ``name`` in the kernel (no user-space buffer)."""
        dst = self.tensor_offset(name) + at
        done = 0
        while done < nbytes:
            n = os.copy_file_range(src_fd, self._fd, nbytes - done, src_offset + done, dst + done)
            if n <= 0:
                raise SafetensorsError(f"copy into {self.path} stopped at {done} of {nbytes} bytes")
            done += n
        with self._lock:
            self._written += nbytes

    def _pwrite(self, data: memoryview | bytes, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += pwrite_uncached(self._fd, view[done:], offset + done)

    def close(self) -> None:
        """Check every tensor byte was written, sync, and move the file to its final name."""
        expected = self.size - self.data_start
        try:
            if self._written != expected:
                raise SafetensorsError(f"{self.path}: wrote {self._written} of {expected} tensor bytes")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        os.close(self._fd)
        self._partial.unlink(missing_ok=True)


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Write ``tensors`` (CPU or device) to one safetensors file; return the ``checksum`` of each tensor."""
    writer = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    sums = {}
    try:
        for name, tensor in tensors.items():
            data = tensor_bytes(tensor)
            sums[name] = checksum(data)
            writer.write(name, data)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return sums
