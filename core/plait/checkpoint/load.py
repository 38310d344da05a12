"""``load_checkpoint``: fill a parallel model (and optimizer, scheduler, RNG) from any saved layout.

Each rank asks, for every box of every local tensor, for exactly the overlapping parts of the saved boxes,
and reads only those bytes (``st_io``). So the same code resumes at the saved layout and reshards to another
tp / pp / dp. Everything that can be checked without reading tensor data (index, files, headers, names,
shapes, coverage) is checked first on every rank; errors from any rank are shared before any tensor is read,
so a bad checkpoint is the same clear error everywhere, never a hang and never half-loaded training.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.base import comm
from plait.base.config import ParallelConfig
from plait.checkpoint.format import (
    Box, CheckpointError, CheckpointPaths, Index, TensorEntry, full_box, intersect, read_index, shape_problems,
    uncovered,
)
from plait.checkpoint.st_io import CHECKSUM, DTYPES, SafetensorsError, SafetensorsFile
from plait.checkpoint.state import (
    ReadOp, load_scheduler_state, local_params, local_views, plan_optimizer_load, set_rng_state,
)
from plait.parallel.fsdp import local, reshard
from plait.parallel_model import ParallelModel
from plait.tp.sharding import ShardSpec

# Config fields that do not change the weights; left out when explaining a mismatch.
_IGNORED_CONFIG = {"architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache"}


@dataclass
class CheckpointState:
    """What ``load_checkpoint`` restored besides tensors: where training stands."""

    path: Path
    step: int
    extra: dict[str, Any]
    saved_config: ParallelConfig
    resharded: bool  # the saved layout (tp, cp, pp, dp, ep, ZeRO stage) differs from this run's
    rng_restored: bool  # RNG states are restored only at the saved layout (rank r gets rank r's states)


class CheckpointReader:
    """Reads any box of any logical tensor of a checkpoint, whatever layout saved it."""

    def __init__(self, paths: CheckpointPaths, index: Index) -> None:
        self.paths, self.index = paths, index
        self._files: dict[str, SafetensorsFile] = {}

    def file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            try:
                self._files[name] = SafetensorsFile(self.paths.shard(name))
            except SafetensorsError as exc:
                raise self.shard_error(name, exc) from None
        return self._files[name]

    def shard_error(self, name: str, exc: SafetensorsError) -> CheckpointError:
        """``exc`` of shard file ``name``, which names the file it read, naming it as the user finds it (in a store,
        the object, not its local copy)."""
        text, local = str(exc), str(self.paths.shards / name)
        return CheckpointError(f"checkpoint shard {self.paths.locate(name)}{text.removeprefix(local)}"
                               if text.startswith(local) else f"checkpoint shard {text}")

    def validate_files(self, names: Iterable[str] | None = None) -> None:
        """Files the index names (all, or ``names``) exist, have the recorded size, a valid header and hold
        the listed tensors with the dtype and shape their pieces need."""
        wanted = set(self.index.files if names is None else names)
        for name in sorted(wanted):
            if name not in self.index.files:
                raise CheckpointError(f"the index of {self.paths.where} points to {name}, which it does not list")
            path = self.paths.shard(name)
            if not path.is_file():
                raise CheckpointError(f"checkpoint shard {self.paths.locate(name)} is missing (the index lists it); "
                                      f"the checkpoint is incomplete")
            size, recorded = path.stat().st_size, self.index.files[name]["size"]
            if size != recorded:
                raise CheckpointError(
                    f"checkpoint shard {self.paths.locate(name)} has {size} bytes, the index recorded {recorded} "
                    f"(truncated or overwritten)"
                )
            self.file(name)
        for logical, entry in self.index.tensors.items():
            for piece in entry.pieces:
                if piece.file not in wanted:
                    continue
                stored = self.file(piece.file).entries.get(piece.key)
                if stored is None:
                    raise CheckpointError(
                        f"checkpoint shard {self.paths.locate(piece.file)} has no tensor {piece.key!r}"
                    )
                lacks = len(entry.shape) - len(stored.shape)  # leading dims one index wide (format.Piece)
                fits = len(piece.box) == len(piece.at) == len(entry.shape) and lacks >= 0 and all(
                    0 <= a < b <= full and 0 <= at and at + b - a <= s
                    for (a, b), at, s, full in zip(piece.box, piece.at, (1,) * lacks + stored.shape, entry.shape)
                )
                if stored.dtype != DTYPES[entry.dtype] or not fits:
                    raise CheckpointError(
                        f"{self.paths.locate(piece.file)}: tensor {piece.key!r} ({stored.dtype}, "
                        f"{list(stored.shape)}) does not hold box {[list(r) for r in piece.box]} of {logical} "
                        f"({entry.dtype}, {list(entry.shape)})"
                    )

    def entry(self, logical: str) -> TensorEntry:
        entry = self.index.tensors.get(logical)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.paths.where} has no tensor {logical}")
        return entry

    def check_covered(self, logical: str, box: Box) -> None:
        """The saved pieces of ``logical`` cover ``box`` (else this layout cannot be loaded from them)."""
        entry = self.entry(logical)
        hole = uncovered(box, [p.box for p in entry.pieces])
        if hole is not None:
            saved = [[list(r) for r in p.box] for p in entry.pieces]
            raise CheckpointError(
                f"checkpoint {self.paths.where} cannot be loaded at this layout: {logical} {list(entry.shape)} region "
                f"{[list(r) for r in hole]} is in no saved piece (saved: {saved}); the checkpoint lacks the ranks "
                f"that held it"
            )

    def read(self, logical: str, box: Box, out: torch.Tensor) -> None:
        """Fill ``out`` (shape of ``box``, any dtype and device) with ``box`` of ``logical``."""
        target = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        for piece in self.entry(logical).pieces:
            inter = intersect(piece.box, box)
            if inter is None:
                continue
            src = tuple((a - p0 + at, b - p0 + at) for (a, b), (p0, _), at in zip(inter, piece.box, piece.at))
            dst = target
            for d, ((a, b), (b0, _)) in enumerate(zip(inter, box)):
                dst = dst.narrow(d, a - b0, b - a)
            try:
                stored = self.file(piece.file)
                lacks = len(src) - len(stored.entry(piece.key).shape)  # leading dims one index wide (format.Piece)
                stored.read_box(piece.key, src[lacks:], dst[(0,) * lacks])
            except SafetensorsError as exc:
                raise self.shard_error(piece.file, exc) from None
        if target is not out:
            out.copy_(target)

    def stored_for(self, reads: Iterable[ReadOp]) -> set[tuple[str, str]]:
        """(file, key) of every stored tensor the reads touch."""
        touched = set()
        for op in reads:
            for piece in self.entry(op.logical).pieces:
                if intersect(piece.box, op.box) is not None:
                    touched.add((piece.file, piece.key))
        return touched

    def verify(self, stored: Iterable[tuple[str, str]], threads: int = 2) -> None:
        """Compare the checksum of each stored tensor with the index (finds flipped or overwritten bytes).

        Threads: ``pread`` and xxhash release the GIL, so files are checked in parallel.
        """
        stored = sorted(stored)
        with ThreadPoolExecutor(threads) as pool:
            actual = list(pool.map(lambda fk: self.file(fk[0]).checksum(fk[1]), stored))
        for (file, key), value in zip(stored, actual):
            expected = self.index.files[file][CHECKSUM][key]
            if value != expected:
                raise CheckpointError(
                    f"checkpoint shard {self.paths.locate(file)}: tensor {key!r} is corrupted "
                    f"({CHECKSUM} checksum {value:#018x}, the index recorded {expected:#018x})"
                )


def load_checkpoint(
    path: str | os.PathLike,
    pmodel: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    *,
    weights: bool = True,
    verify: bool = True,
) -> CheckpointState:
    """Restore ``pmodel`` (and optionally ``optimizer``, ``scheduler``) from ``path`` at this run's layout.

    Every rank must call it. ``path`` is a checkpoint directory or its shard folder. ``weights=False``
    skips the parameters (already loaded, e.g. by ``load_parallel_model(path)``). ``verify`` checks the
    checksum of every stored tensor this rank reads from. Raises CheckpointError on every rank, naming the
    file and values, when the checkpoint is missing, damaged or does not fit: before any tensor is read for
    everything but flipped bytes, which the checksums find before training can start.
    """
    paths, index = read_index(path)
    reader = CheckpointReader(paths, index)
    world = comm.world_group()
    reads: list[ReadOp] = []
    finish: Callable[[], None] | None = None
    stored: set[tuple[str, str]] = set()
    error = None
    reshard(pmodel.fsdp)  # ZeRO-2/3: read into the shards, even where a forward left gathered copies registered
    found = local_params(pmodel.module, pmodel.param_specs)
    params, specs, buffers = found.params, found.specs, found.buffers
    try:
        if pmodel.plan.lora is not None:  # the base came from the checkpoint's reference (materialize)
            params = {n: p for n, p in params.items() if n in pmodel.plan.lora.param_names()}
            specs = {n: specs[n] for n in params}
            buffers = {}  # the base's, as its parameters: from the checkpoint's reference
        if (pmodel.plan.lora is None) != ("lora" not in index.extra):
            raise CheckpointError(
                f"checkpoint {paths.where} {'holds' if 'lora' in index.extra else 'holds no'} LoRA adapters but the "
                f"model {'trains none' if pmodel.plan.lora is None else 'trains LoRA'}; resume with the same --lora_r"
            )
        _check_model(index, pmodel, specs, buffers, paths)
        if weights:
            for name, param in params.items():
                reads += local_views(specs[name], local(param).detach(), name)
            for name, buffer in buffers.items():
                reads.append(ReadOp(name, full_box(tuple(buffer.shape)), buffer))
        if optimizer is not None:
            if index.optimizer is None:
                raise CheckpointError(
                    f"checkpoint {paths.where} has no optimizer state; pass optimizer=None to load weights only"
                )
            names = {param: name for name, param in params.items()}
            opt_reads, finish = plan_optimizer_load(
                optimizer, names, specs, index.optimizer, index.tensors
            )
            reads += opt_reads
        if scheduler is not None and index.scheduler is None:
            raise CheckpointError(f"checkpoint {paths.where} has no scheduler state; pass scheduler=None")
        for op in reads:
            reader.check_covered(op.logical, op.box)
        stored = reader.stored_for(reads)
        reader.validate_files({file for file, _ in stored})
    except CheckpointError as exc:
        error = str(exc)
    _share_errors(error, world)

    try:
        if verify:
            reader.verify(stored)
        with torch.no_grad():
            for op in reads:
                reader.read(op.logical, op.box, op.out)
            if weights:
                _zero_padding(params, specs)
    except CheckpointError as exc:
        error = str(exc)
    _share_errors(error, world)

    if finish is not None:
        finish()
    if scheduler is not None:
        load_scheduler_state(scheduler, index.scheduler)
    saved = _parallel_config(index)
    layout = lambda c: (c.tp, c.cp, c.pp, c.dp)  # noqa: E731
    same_layout = layout(saved) == layout(pmodel.config) and index.world_size == pmodel.mesh.world_size
    if same_layout:  # the same ranks at the same coordinates: each takes its own states, whatever the ZeRO stage
        set_rng_state(index.ranks[pmodel.mesh.rank]["rng"])
    sharding = lambda c: (c.ep, c.zero_stage, c.zero_1)  # noqa: E731  (how the same ranks hold the tensors)
    resharded = not same_layout or sharding(saved) != sharding(pmodel.config)
    return CheckpointState(paths.root, index.step, index.extra, saved, resharded, same_layout)


def _share_errors(error: str | None, world) -> None:
    """Raise the same CheckpointError on every rank if any rank found a problem."""
    errors = comm.all_gather_object(error, world)
    unique = list(dict.fromkeys(e for e in errors if e))
    if unique:
        raise CheckpointError("; ".join(unique))


def _zero_padding(params: dict[str, torch.nn.Parameter], specs: dict[str, ShardSpec]) -> None:
    for name, param in params.items():
        padding = specs[name].padding(local(param).detach())
        if padding is not None:
            padding.zero_()


def _check_model(
    index: Index, pmodel: ParallelModel, specs: dict[str, ShardSpec], buffers: dict[str, torch.Tensor],
    paths: CheckpointPaths,
) -> None:
    config = pmodel.module.config
    if index.model_type != config.model_type:
        classes = ", ".join(index.model_config.get("architectures") or [])
        raise CheckpointError(
            f"checkpoint {paths.where} holds a {index.model_type!r} model{f' ({classes})' if classes else ''}; "
            f"this model is {config.model_type!r} ({type(pmodel.module).__name__})"
        )
    wanted = {**{name: spec.full_shape for name, spec in specs.items()}, **{n: b.shape for n, b in buffers.items()}}
    problems = shape_problems(index.params(), wanted, "checkpoint", "model")
    if problems:
        current = config.to_dict()
        differs = [f"{k}: checkpoint {v!r} vs model {current.get(k)!r}" for k, v in index.model_config.items()
                   if k not in _IGNORED_CONFIG and current.get(k) != v and not isinstance(v, dict)]
        raise CheckpointError(
            f"checkpoint {paths.where} does not match the model config: {'; '.join(problems)}"
            + (f" (config differs: {', '.join(differs[:8])})" if differs else "")
        )


def saved_layout(path: str | os.PathLike) -> ParallelConfig:
    """The ParallelConfig a checkpoint was saved with (for logs and ``plait plan``)."""
    return _parallel_config(read_index(path)[1])


def _parallel_config(index: Index) -> ParallelConfig:
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    data = {k: v for k, v in index.parallel_config.items() if k in known}
    data["pipeline_cuts"] = tuple(data.get("pipeline_cuts", ()))
    return ParallelConfig(**data)

