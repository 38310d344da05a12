"""``consolidate``: a plait checkpoint (any layout) -> a plain Hugging Face model directory.

Streams one tensor at a time: a tensor whose saved pieces are whole rows of it is copied file to file in the
kernel (``copy_file_range``); any other (column-split) tensor is assembled a block of rows at a time from
the overlapping parts of its pieces. Peak memory is a few blocks, not the model. Vocab padding was never
saved, and tied weights are written once under the name transformers keeps, so
``AutoModelForCausalLM.from_pretrained(output_dir)`` loads the result without missing or unexpected keys.

Everything is checked (index, files, names and shapes against the model config) before the output is
created; checksums are checked while it is written to a temporary folder, which is renamed into place only when
everything passed: a bad checkpoint writes nothing.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PretrainedConfig

from plait.base.config import ConfigError
from plait.base.meta import build_meta_model
from plait.checkpoint.format import (
    CheckpointError, Index, TensorEntry, full_box, model_config, read_index, shape_problems, write_json,
)
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.st_io import DTYPES, SafetensorsWriter, byte_view, tensor_bytes
from plait.checkpoint.state import local_params, optimizer_key

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "processor_config.json", "preprocessor_config.json")  # an image-text model's processor too
# Tensors that pass through memory are assembled and written a block of rows at a time. A block that stays in
# the CPU cache between the read that fills it and the pwrite that empties it made those writes 3-5x faster
# than 16 MiB blocks (240 MiB of column-split weights: pwrite 0.1-0.2 s against 0.6-1.3 s).
BLOCK_BYTES = 1 << 20
DEFAULT_SHARD_SIZE = "5GB"  # --max_shard_size's default, for a whole model and a merged LoRA one alike
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}


class Planned(NamedTuple):
    """One tensor of the output: ``name`` written in ``dtype`` from the checkpoint's logical tensor ``source``
    (``entry``): the parameter itself, or its fp32 master (``weight_source``)."""

    name: str
    source: str
    entry: TensorEntry
    dtype: torch.dtype


def consolidate(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    format: str = "safetensors",
    dtype: str | torch.dtype | None = None,
    *,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    verify: bool = True,
) -> Path:
    """Write the model of ``checkpoint_dir`` (a checkpoint or its shard folder) as a Hugging Face directory.

    ``format``: "safetensors" (model.safetensors, or shards plus model.safetensors.index.json above
    ``max_shard_size``) or "pytorch" (pytorch_model.bin, same sharding). ``dtype``: cast floating tensors
    (e.g. "bfloat16"); None keeps the saved dtype; one finer than bf16 parameters writes their fp32 masters
    where the checkpoint has them (``weight_source``). Also writes config.json, generation_config.json and the
    tokenizer files the checkpoint has. ``verify``: check every tensor's checksum (while writing). The
    output directory must not exist or be empty. Returns ``output_dir``.
    """
    if format not in ("safetensors", "pytorch"):
        raise ConfigError(f"format={format!r} is unknown; choose 'safetensors' or 'pytorch'")
    out_dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    output = Path(output_dir)
    check_output_dir(output)

    paths, index = read_index(checkpoint_dir)
    if "lora" in index.extra:  # its tensors are the adapters alone: the base would be reported missing
        raise ConfigError(f"{paths.where} is a LoRA checkpoint (the adapters and a reference to the base); write it "
                          f"with plait.checkpoint.lora_export.consolidate_lora(..., 'adapter' or 'merged'), or `plait consolidate "
                          f"--lora adapter|merged`")
    reader = CheckpointReader(paths, index)
    config = model_config(index)
    plan = []
    for name in _check_tensors(index, config, paths.where):
        source = weight_source(index, name, out_dtype)
        entry = index.tensors[source]
        saved_dtype = DTYPES[index.tensors[name].dtype]
        cast = out_dtype is not None and saved_dtype.is_floating_point
        plan.append(Planned(name, source, entry, out_dtype if cast else saved_dtype))
    stored = {(p.file, p.key) for item in plan for p in item.entry.pieces}
    reader.validate_files({file for file, _ in stored})  # the files read: the optimizer's only for masters
    for item in plan:
        reader.check_covered(item.source, full_box(item.entry.shape))

    tmp = output.with_name(f".{output.name}.consolidating")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # Checksums are verified while the output is written, and before it is moved into place.
        with ThreadPoolExecutor(1) as pool:
            checking = pool.submit(reader.verify, stored) if verify else None
            _write_model(reader, tmp, plan, format, max_bytes)
            if checking is not None:
                checking.result()
        config.dtype = next((item.dtype for item in plan if item.dtype.is_floating_point), torch.float32)
        config.save_pretrained(tmp)
        for extra in ("generation_config.json", *TOKENIZER_FILES):
            if (paths.root / extra).is_file():
                shutil.copyfile(paths.root / extra, tmp / extra)
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def weight_source(index: Index, name: str, dtype: torch.dtype | None) -> str:
    """The logical tensor to write parameter ``name`` from in ``dtype``: its master (``optimizer/<name>/master``,
    which ``MasterWeightOptimizer`` saves beside bf16 parameters) where both ``dtype`` and the master are finer
    (more mantissa bits) than the saved parameter, which is only the master rounded: casting it would keep that
    rounding (float16 from bf16 too: its 10 mantissa bits against bf16's 7; its range is no concern here, a value
    past float16's is past it in bf16 as well). For a dtype no finer, the saved parameter is the master rounded to
    it already; without a master, the parameter."""
    master = index.tensors.get(optimizer_key(name, "master"))
    saved = DTYPES[index.tensors[name].dtype]
    if master is None or dtype is None or not saved.is_floating_point:
        return name
    eps = torch.finfo(saved).eps
    finer = torch.finfo(dtype).eps < eps and torch.finfo(DTYPES[master.dtype]).eps < eps
    return optimizer_key(name, "master") if finer else name


def _write_model(reader: CheckpointReader, folder: Path, plan: list[Planned], format: str, max_bytes: int) -> None:
    """The weight files (one, or shards plus the index transformers reads) of ``plan`` into ``folder``."""
    shards = _split(plan, max_bytes)
    stem, ext = ("model", "safetensors") if format == "safetensors" else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if len(shards) == 1 else \
        [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    weight_map = {}
    for filename, shard in zip(names, shards):
        if format == "safetensors":
            _write_safetensors(reader, folder / filename, shard)
        else:
            _write_pytorch(reader, folder / filename, shard)
        weight_map.update({item.name: filename for item in shard})
    if len(shards) > 1:
        total = sum(math.prod(item.entry.shape) * item.dtype.itemsize for item in plan)
        write_json(folder / f"{stem}.{ext}.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _check_tensors(index, config: PretrainedConfig, root: str) -> list[str]:
    """The checkpoint's model tensors (parameters, then persistent buffers: the model's ``state_dict``), in the
    model's order; error if they are not exactly the model's."""
    model = build_meta_model(config)
    if not config.architectures:
        config.architectures = [type(model).__name__]
    shapes = local_params(model).shapes()
    saved = index.params()
    unexpected = [n for n in saved if n not in shapes]
    problems = shape_problems(saved, shapes, "checkpoint", "config")
    problems += [f"unexpected {unexpected[:5]}"] if unexpected else []
    if problems:
        raise CheckpointError(f"checkpoint {root} does not match its model config: {'; '.join(problems)}")
    return list(shapes)


def _split(plan: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Greedy shards in model order; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in plan:
        nbytes = math.prod(item.entry.shape) * item.dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _row_blocks(shape: tuple[int, ...], itemsize: int) -> tuple[int, int, int]:
    """(rows, bytes per row, rows per block) of a tensor seen as rows of its first dim (0-d: one row)."""
    rows = shape[0] if shape else 1
    row_bytes = math.prod(shape[1:]) * itemsize
    return rows, row_bytes, max(1, BLOCK_BYTES // max(row_bytes, 1))


def _read_rows(reader: CheckpointReader, name: str, entry: TensorEntry, r0: int, r1: int) -> torch.Tensor:
    if not entry.shape:
        out = torch.empty((), dtype=DTYPES[entry.dtype])
        reader.read(name, (), out)
        return out
    box = ((r0, r1), *full_box(entry.shape[1:]))
    out = torch.empty((r1 - r0, *entry.shape[1:]), dtype=DTYPES[entry.dtype])
    reader.read(name, box, out)
    return out


def _row_pieces(reader: CheckpointReader, entry: TensorEntry):
    """When the pieces are disjoint whole-row blocks stored contiguously: (src file, src offset, row range) each."""
    if not entry.shape:
        return None
    found = []
    for piece in entry.pieces:
        stored = reader.file(piece.file).entry(piece.key)
        if piece.box[1:] != full_box(entry.shape[1:]) or stored.shape[1:] != entry.shape[1:] or any(piece.at[1:]):
            return None
        found.append((piece.box[0], piece, stored))
    found.sort(key=lambda x: x[0])
    edges = [0] + [e for (a, b), _, _ in found for e in (a, b)] + [entry.shape[0]]
    if any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)):
        return None  # gaps or overlaps (replicas): assemble through memory instead
    return found


def _column_bands(reader: CheckpointReader, entry: TensorEntry):
    """When every piece of a matrix is a band of whole stored rows (a column split): (file, piece, stored) each."""
    if len(entry.shape) != 2:
        return None
    bands = []
    for piece in entry.pieces:
        file = reader.file(piece.file)
        stored = file.entry(piece.key)
        if piece.at[1] != 0 or piece.box[1][1] - piece.box[1][0] != stored.shape[1]:
            return None
        bands.append((file, piece, stored))
    return bands


def _read_bands(bands: list, entry: TensorEntry, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a column-split matrix: each band's rows are one run of its file, scattered by a
    ``preadv`` straight into their columns of the output rows (no temporary, no strided copy)."""
    width = entry.shape[1]
    out = torch.empty((r1 - r0, width), dtype=DTYPES[entry.dtype])
    item = out.element_size()
    memory = byte_view(out)
    for file, piece, stored in bands:
        (a0, b0), (c0, c1) = piece.box
        lo, hi = max(r0, a0), min(r1, b0)
        if lo >= hi:
            continue
        run = (c1 - c0) * item
        views = [memory[((row - r0) * width + c0) * item:][:run] for row in range(lo, hi)]
        file.read_scatter(stored.start + (lo - a0 + piece.at[0]) * stored.shape[1] * item, views)
    return out


def _write_safetensors(reader: CheckpointReader, path: Path, shard: list[Planned], threads: int = 2) -> None:
    """Tensors are written by ``threads`` threads at their own offsets: the copies run in the kernel or in
    torch with the GIL released, so two cores copy twice the bytes."""
    writer = SafetensorsWriter(path, [(item.name, item.dtype, item.entry.shape) for item in shard])

    def write_one(item: Planned) -> None:
        name, source, entry, dtype = item
        rows, row_bytes, block = _row_blocks(entry.shape, dtype.itemsize)
        pieces = _row_pieces(reader, entry) if dtype == DTYPES[entry.dtype] else None
        if pieces is not None:
            for (a, b), piece, stored in pieces:
                with open(reader.file(piece.file).path, "rb") as src:
                    writer.copy_from(src.fileno(), stored.start + piece.at[0] * row_bytes, (b - a) * row_bytes,
                                     name, a * row_bytes)
            return
        bands = _column_bands(reader, entry)
        for r0 in range(0, rows, block):
            r1 = min(r0 + block, rows)
            if bands is not None:
                data = _read_bands(bands, entry, r0, r1).to(dtype)
            else:
                data = _read_rows(reader, source, entry, r0, r1).to(dtype)
            writer.write(name, tensor_bytes(data), r0 * row_bytes)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write_one, sorted(shard, key=lambda item: -math.prod(item.entry.shape))))
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _write_pytorch(reader: CheckpointReader, path: Path, shard: list[Planned]) -> None:
    """One ``torch.save`` per shard: a shard's tensors are in memory together (bounded by max_shard_size)."""
    state = {}
    for name, source, entry, dtype in shard:
        full = torch.empty(entry.shape, dtype=dtype)
        rows, _, block = _row_blocks(entry.shape, full.element_size())
        for r0 in range(0, rows, block):
            r1 = min(r0 + block, rows)
            target = full[r0:r1] if entry.shape else full
            target.copy_(_read_rows(reader, source, entry, r0, r1))
        state[name] = full
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype from its name (``--dtype``), checked before any weight is read; None keeps the saved dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ConfigError(f"dtype={dtype!r} is unknown; choose one of {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def check_output_dir(output: Path) -> None:
    """The output directory must be new or empty, and makeable: refused by name rather than by the OS mid-write."""
    if output.is_file():
        raise ConfigError(f"output directory {output} is an existing file; choose a directory")
    if output.is_dir() and any(output.iterdir()):
        raise ConfigError(f"output directory {output} exists and is not empty; choose a new one")
    existing = next(p for p in (output, *output.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"output directory {output} cannot be made: {existing} is a file; choose another path")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "2GiB" (Hugging Face's convention: GB = 10**9)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
    if not match:
        raise ConfigError(f"max_shard_size={size!r} is not a size such as 5GB or 500MB")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    found = int(float(match.group(1)) * units[match.group(2)])
    if found < 1:  # 0 wrote one file per tensor
        raise ConfigError(f"max_shard_size={size!r} is no bytes; give a size such as 5GB or 500MB")
    return found

