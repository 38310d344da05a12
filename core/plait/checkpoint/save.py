"""``save_checkpoint``: every rank writes the boxes it owns, rank 0 writes the index, then one rename.

A box held by several ranks (replicated tensors, dp replicas, kv heads shared by tp ranks) is written once,
by the lowest rank holding it, so the checkpoint is the size of the model and its optimizer state whatever
the layout. Everything is written into ``<path>.tmp`` (each file through ``.partial`` + ``os.replace``), and
rank 0 renames the folder after every rank has reported success: a crash mid-save leaves only a ``.tmp``
folder, never a checkpoint that looks complete. At a URL (``plait.checkpoint.store``) each rank writes into a
folder of its own on its local disk and uploads its files, and rank 0 commits the checkpoint last of all; a step
saved again goes beside its committed checkpoint until its own commit replaces it (``store.begin_save``), as the
renamed ``.tmp`` folder replaces an older checkpoint on a disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.base import comm
from plait.base import faults
from plait.base.config import FaultError
from plait.checkpoint import store
from plait.checkpoint.format import INDEX, SHARDS, CheckpointError, Index, Piece, TensorEntry, write_json
from plait.checkpoint.st_io import CHECKSUM, NAMES, write_tensors
from plait.checkpoint.state import (
    LocalTensor, buffer_tensors, local_params, merge_optimizer_meta, optimizer_state, param_tensors, rng_state,
    scheduler_state, to_json,
)
from plait.lora.base import lora_record
from plait.parallel.fsdp import reshard
from plait.parallel_model import ParallelModel


class CheckpointNotSaved(FaultError):
    """Writing a checkpoint failed on some rank (a full disk, a quota, a file size limit): the partial folder
    is removed and the previous checkpoint stays the newest."""


def save_checkpoint(
    path: str | os.PathLike,
    pmodel: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    *,
    tokenizer: Any | None = None,
) -> Path | str:
    """Save model, optimizer, scheduler, RNG and data position (``step``, ``extra``) at ``path`` (a folder, or a URL
    in a store).

    Every rank must call it. ``extra`` is JSON-safe trainer state (e.g. the sampler's position);
    ``tokenizer`` (rank 0's is used) is saved beside the weights so ``consolidate`` can ship it.
    Returns the checkpoint directory; raises on every rank if any rank failed: CheckpointError for state that
    cannot be saved, CheckpointNotSaved for a write that failed.
    """
    pending = prepare_save(path, pmodel, optimizer, scheduler, step, extra, tokenizer=tokenizer)
    return write_save(pending, comm.world_group())


@dataclasses.dataclass
class PendingSave:
    """A checkpoint whose metadata every rank has agreed on (``prepare_save``) and whose tensors are yet to be
    written (``write_save``): what this rank writes, in the tensors it holds or in host copies of them."""

    url: str | None
    path: Path  # the checkpoint folder, or at a URL this rank's staging folder
    rank: int
    step: int
    tensors: list[LocalTensor]  # those holding at least one box this rank owns
    owner: dict[tuple[str, tuple], int]
    metas: list[dict[str, Any]]
    aliases: dict[str, str]
    pmodel: ParallelModel
    tokenizer: Any | None

    def host_copy(self, reuse: list[torch.Tensor] | None = None) -> int:
        """Copy every tensor this rank writes to host memory, so that training may change its own at once; the bytes
        copied (what an asynchronous save costs in host memory). ``reuse``: the host tensors of the previous save,
        written out already, copied into where shape and dtype agree (every save after the first: no new
        allocation, no page faults on hundreds of MB each time)."""
        copied = 0
        for i, t in enumerate(self.tensors):
            source = t.tensor.detach()
            old = reuse[i] if reuse is not None and i < len(reuse) else None
            if old is not None and old.shape == source.shape and old.dtype == source.dtype:
                t.tensor = old.copy_(source)
            else:
                t.tensor = source.to("cpu", copy=True)
            copied += t.tensor.numel() * t.tensor.element_size()
        return copied


def prepare_save(
    path: str | os.PathLike,
    pmodel: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
    *,
    tokenizer: Any | None = None,
) -> PendingSave:
    """The first half of ``save_checkpoint``, on every rank at the same step: each rank's state and metadata, and
    which rank writes each box (gathered over the world). Raises CheckpointError on every rank for state that
    cannot be saved."""
    url = str(path) if store.is_url(path) else None
    mesh = pmodel.mesh
    path = store.stage(url, mesh.rank) / "save" if url else Path(path)  # at a URL, this rank's files first
    world = comm.world_group()

    tensors: list[LocalTensor] = []
    local: dict[str, Any] = {"rank": mesh.rank, "error": None, "optimizer": None}
    aliases: dict[str, str] = {}
    reshard(pmodel.fsdp)  # ZeRO-2/3: the shards, even where a forward without backward left gathered copies
    try:
        found = local_params(pmodel.module, pmodel.param_specs)
        aliases = found.aliases
        if pmodel.plan.lora is not None:  # only what changes: the adapters, and a reference to the frozen base
            found.params = {n: p for n, p in found.params.items() if n in pmodel.plan.lora.param_names()}
            extra = {**(extra or {}), "lora": lora_record(pmodel)}
        tensors = param_tensors(found.params, found.specs)
        if pmodel.plan.lora is None:  # a LoRA checkpoint's base (buffers included) comes from its reference
            tensors += buffer_tensors(found.buffers)
        if optimizer is not None:
            names = {param: name for name, param in found.params.items()}
            opt_tensors, local["optimizer"] = optimizer_state(optimizer, names, found.specs)
            tensors += opt_tensors
        local["scheduler"] = scheduler_state(scheduler) if scheduler is not None else None
        local["extra"] = to_json(extra or {})
    except CheckpointError as exc:
        local["error"] = str(exc)
    local["coords"] = {"tp_rank": mesh.tp_rank, "cp_rank": mesh.cp_rank, "ep_rank": mesh.ep_rank, "pp_rank": mesh.pp_rank,
                       "dp_rank": mesh.dp_rank}
    local["rng"] = rng_state()
    local["boxes"] = [(t.logical, [box for box, _ in t.boxes]) for t in tensors]
    metas = comm.all_gather_object(local, world)
    _raise_errors(metas, f"checkpoint {path} was not saved")

    owner: dict[tuple[str, tuple], int] = {}
    for meta in metas:
        for logical, boxes in meta["boxes"]:
            for box in boxes:
                owner.setdefault((logical, tuple(box)), meta["rank"])
    mine = [t for t in tensors if any(owner[(t.logical, box)] == mesh.rank for box, _ in t.boxes)]
    return PendingSave(url, path, mesh.rank, step, mine, owner, metas, aliases, pmodel, tokenizer)


def write_save(pending: PendingSave, group: dist.ProcessGroup | None) -> Path | str:
    """The second half of ``save_checkpoint``: every rank writes its files into the temporary folder, rank 0 the
    index, then the rename (or at a URL the uploads and the commit object). Its collectives run on ``group``, the
    world's ranks (a group of its own for a save in the background). Raises CheckpointNotSaved on every rank for
    a write that failed, the temporary folder removed."""
    url, path, rank = pending.url, pending.path, pending.rank
    tmp = path.with_name(path.name + ".tmp")
    faults.maybe_inject(pending.step, "write")  # testing aid, as below
    if rank == 0 or url:  # a folder every rank shares, or each rank's own
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True)
    target = None  # at a URL: where this save's files go, rank 0's choice (a collective, so a failure is everyone's)
    if url:
        begun: tuple[str | None, str | None] = (None, None)
        if rank == 0:
            try:
                begun = (store.begin_save(url), None)
            except OSError as exc:
                begun = (None, f"checkpoint {url} was not saved: {exc}")
        target, error = comm.all_gather_object(begun, group)[0]
        if error:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointNotSaved(error)
    else:
        comm.barrier(group)

    report: dict[str, Any] = {"error": None, "files": {}, "pieces": {}, "entries": {}}
    try:
        for kind, prefix in (("param", "model"), ("optim", "optim")):
            _write_owned([t for t in pending.tensors if t.kind == kind], pending.owner, rank,
                         f"{prefix}-rank{rank:05d}.safetensors", tmp / SHARDS, report)
    except OSError as exc:
        report["error"] = f"writing {tmp}: {exc}"
    if url and report["error"] is None:
        try:
            for name in report["files"]:
                store.upload(tmp / SHARDS / name, store.join(target, SHARDS, name))
        except OSError as exc:
            report["error"] = str(exc)
    faults.maybe_inject(pending.step, "save")  # testing aid: a no-op unless PLAIT_FAULT_INJECT names this save
    reports = comm.all_gather_object(report, group)
    try:
        _raise_errors(reports, f"checkpoint {path} was not saved", CheckpointNotSaved)
    except CheckpointNotSaved:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    if rank == 0:
        pmodel = pending.pmodel
        if not pmodel.module.config.architectures:  # as transformers' save_pretrained does
            pmodel.module.config.architectures = [type(pmodel.module).__name__]
        index = _build_index(pmodel, pending.step, pending.metas, reports, pending.aliases)
        write_json(tmp / SHARDS / INDEX, index.to_json())
        pmodel.module.config.save_pretrained(tmp)
        if getattr(pmodel.module, "generation_config", None) is not None:
            pmodel.module.generation_config.save_pretrained(tmp)
        if pending.tokenizer is not None:
            pending.tokenizer.save_pretrained(tmp)
        if url:
            committed = _commit(tmp, url, target, set(reports[0]["files"]))
        else:
            _replace_dir(tmp, path)
    if not url:
        comm.barrier(group)
        return path
    error = comm.all_gather_object(committed if rank == 0 else None, group)[0]  # rank 0's, on every rank
    shutil.rmtree(tmp, ignore_errors=True)
    if error:
        raise CheckpointNotSaved(error)
    return url


def _commit(tmp: Path, url: str, target: str, uploaded: set[str]) -> str | None:
    """Upload rank 0's other files (the index, the config, the tokenizer) to ``target``, where this save's files go,
    then the commit object making them the checkpoint at ``url``; the error that stopped it, or None."""
    try:
        store.upload_tree(tmp, target, skip={f"{SHARDS}/{name}" for name in uploaded})
        store.commit(url, target)
    except OSError as exc:
        return f"checkpoint {url} was not saved: {exc}"
    return None


def _write_owned(
    tensors: list[LocalTensor], owner: dict, rank: int, filename: str, folder: Path, report: dict[str, Any]
) -> None:
    """Write the tensors holding at least one box this rank owns; record their pieces in ``report``.

    A logical tensor may come in several local tensors (a ZeRO slice split into boxes): the second and later
    are stored as ``<name>#1``, ``<name>#2`` ...
    """
    to_write: dict[str, torch.Tensor] = {}
    for t in tensors:
        owned = [(box, at) for box, at in t.boxes if owner[(t.logical, box)] == rank]
        if not owned:
            continue
        key, n = t.logical, 0
        while key in to_write:
            n += 1
            key = f"{t.logical}#{n}"
        to_write[key] = t.tensor
        report["entries"][t.logical] = (t.kind, NAMES[t.tensor.dtype], list(t.full_shape))
        report["pieces"].setdefault(t.logical, []).extend(Piece(filename, key, box, at).to_json() for box, at in owned)
    if to_write:
        sums = write_tensors(folder / filename, to_write)
        report["files"][filename] = {"size": (folder / filename).stat().st_size, CHECKSUM: sums}


def _raise_errors(reports: list[dict[str, Any]], what: str, error: type[Exception] = CheckpointError) -> None:
    errors = [f"rank {rank}: {r['error']}" for rank, r in enumerate(reports) if r["error"]]
    if errors:
        raise error(f"{what}: " + "; ".join(errors))


def _build_index(pmodel: ParallelModel, step: int, metas: list, reports: list, aliases: dict[str, str]) -> Index:
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, dict[str, Any]] = {}
    for report in reports:
        files.update(report["files"])
        for logical, (kind, dtype, shape) in report["entries"].items():
            entry = tensors.setdefault(logical, TensorEntry(kind, dtype, tuple(shape)))
            entry.pieces += [Piece.from_json(p) for p in report["pieces"][logical]]
    optimizer = merge_optimizer_meta([m["optimizer"] for m in metas])
    config = pmodel.module.config
    return Index(
        step=step, model_type=config.model_type, model_config=json.loads(config.to_json_string()),
        parallel_config=dataclasses.asdict(pmodel.config), world_size=len(metas), tensors=tensors, files=files,
        aliases=aliases, optimizer=optimizer, scheduler=metas[0]["scheduler"],
        ranks=[{"rank": m["rank"], **m["coords"], "rng": m["rng"]} for m in metas], extra=metas[0]["extra"],
    )


def _replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` folder to ``path``, replacing an older checkpoint there."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
