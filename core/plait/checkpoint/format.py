"""The checkpoint format: a JSON index of logical tensors and the boxes each per-rank file holds.

Every piece of saved state (a parameter, an optimizer moment, a ZeRO slice of one) is described the same way:
the logical tensor it belongs to (its full shape and dtype), the box of the full tensor it holds (one
[start, stop) per dim) and where that box starts inside the stored tensor (``at``). Loading any layout then
means: for each box this rank needs, copy the overlapping parts of the saved boxes. Nothing in the format
knows about tp, pp or dp, so a checkpoint saved at one layout loads at any other.

Layout of a checkpoint directory (``checkpoint-<step>/``)::

    config.json, generation_config.json, tokenizer files   # for consolidation and inspection
    shards/index.json                                      # this module's Index
    shards/model-rank00000.safetensors ...                 # parameters owned by each rank
    shards/optim-rank00000.safetensors ...                 # optimizer state owned by each rank
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import CONFIG_MAPPING, PretrainedConfig

from plait.base.config import ConfigError
from plait.checkpoint import store
from plait.tp.sharding import ShardSpec

FORMAT = "plait-checkpoint"
VERSION = 1
SHARDS = "shards"
INDEX = "index.json"
CHECKPOINT_PREFIX = "checkpoint-"

Box = tuple[tuple[int, int], ...]


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: missing, damaged, or not matching the model. Raised before training."""


# --------------------------------------------------------------------------------------------------
# Box math
# --------------------------------------------------------------------------------------------------


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, s) for s in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap (or either is empty)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def spec_boxes(spec: ShardSpec) -> list[tuple[Box, tuple[int, ...]]]:
    """(box of the full tensor, start of that box in the local tensor) for each block ``spec`` holds (tp ranges,
    and under ep the experts' ranges, wherever its ``expert_axis`` puts them). Vocab padding is not part of any
    box: it is never saved as data."""
    return spec.boxes()


def uncovered(target: Box, boxes: Iterable[Box]) -> Box | None:
    """A cell of ``target`` that no box covers (None when fully covered).

    Cuts ``target`` along every box boundary and checks each cell: boxes come from splitting dims, so the
    number of cells stays small (a few per dim).
    """
    boxes = [b for b in (intersect(target, x) for x in boxes) if b is not None]
    cuts = []
    for d, (lo, hi) in enumerate(target):
        points = {lo, hi} | {p for b in boxes for p in b[d] if lo < p < hi}
        cuts.append(sorted(points))
    for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
        if not any(all(b[d][0] <= cell[d][0] and cell[d][1] <= b[d][1] for d in range(len(cell))) for b in boxes):
            return tuple(cell)
    return None


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int, int]]:
    """Decompose the flat (row-major) element range [start, stop) of a tensor of ``shape`` into boxes.

    Returns (box, flat_start, flat_stop) with each box's elements being exactly the flat range, so a slice
    of a flattened buffer can be stored zero-copy as ``flat[flat_start:flat_stop].view(box sizes)``. For
    optimizers whose ``plait_state`` (see ``state``) holds a dp rank's slice of a flattened parameter: saved
    as these boxes, the slices regroup on load at any dp size or into a plain optimizer. plait's own
    ``Zero1Optimizer`` partitions whole parameters and does not need it.
    """
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {list(shape)}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [(((start, stop),), start, stop)]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (stop - 1) // inner
    out: list[tuple[Box, int, int]] = []
    if first_row == last_row or start % inner:
        row_stop = min(stop, (first_row + 1) * inner)
        for box, a, b in flat_range_boxes(shape[1:], start - first_row * inner, row_stop - first_row * inner):
            out.append((((first_row, first_row + 1), *box), a + first_row * inner, b + first_row * inner))
        start = row_stop
    if start < stop:
        whole_stop = (stop // inner) * inner
        if whole_stop > start:
            box = ((start // inner, whole_stop // inner), *full_box(shape[1:]))
            out.append((box, start, whole_stop))
            start = whole_stop
        if start < stop:
            row = start // inner
            for box, a, b in flat_range_boxes(shape[1:], 0, stop - start):
                out.append((((row, row + 1), *box), a + start, b + start))
    return out


# --------------------------------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """Stored tensor ``key`` of ``file`` holds ``box`` of the logical tensor, starting at ``at`` in it.

    The stored tensor may lack leading dims of the logical tensor where the box is one index wide on them (its
    ``at`` there is 0): a model directory stores each expert of a stacked expert weight on its own
    (``hf_conversion``).
    """

    file: str
    key: str
    box: Box
    at: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "box": [list(r) for r in self.box], "at": list(self.at)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Piece":
        return cls(data["file"], data["key"], tuple((int(a), int(b)) for a, b in data["box"]),
                   tuple(int(x) for x in data["at"]))


@dataclass
class TensorEntry:
    """One logical tensor: ``kind`` is "param" or "optim"; ``dtype`` a safetensors dtype name."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TensorEntry":
        return cls(data["kind"], data["dtype"], tuple(int(s) for s in data["shape"]),
                   [Piece.from_json(p) for p in data["pieces"]])


@dataclass
class Index:
    """Everything but the tensor bytes: what each file holds, and the non-tensor training state."""

    step: int
    model_type: str
    model_config: dict[str, Any]
    parallel_config: dict[str, Any]
    world_size: int
    tensors: dict[str, TensorEntry]
    files: dict[str, dict[str, Any]]  # file name -> {"size": bytes, "xxh3_64": {key: checksum}}
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter name -> saved (canonical) name
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: coordinates and RNG states
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "step": self.step, "model_type": self.model_type,
            "model_config": self.model_config, "parallel_config": self.parallel_config,
            "world_size": self.world_size, "aliases": self.aliases, "files": self.files,
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "optimizer": self.optimizer, "scheduler": self.scheduler, "ranks": self.ranks, "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Index":
        return cls(
            step=int(data["step"]), model_type=data["model_type"], model_config=data["model_config"],
            parallel_config=data["parallel_config"], world_size=int(data["world_size"]),
            tensors={name: TensorEntry.from_json(t) for name, t in data["tensors"].items()},
            files=data["files"], aliases=data.get("aliases", {}), optimizer=data.get("optimizer"),
            scheduler=data.get("scheduler"), ranks=data.get("ranks", []), extra=data.get("extra", {}),
        )

    def params(self) -> dict[str, TensorEntry]:
        return {name: t for name, t in self.tensors.items() if t.kind == "param"}


def model_config(index: Index) -> PretrainedConfig:
    """The transformers config of the model an index holds (a checkpoint's, or a model directory's config.json)."""
    data = dict(index.model_config)
    model_type = data.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"checkpoint model_type {model_type!r} is unknown to this transformers version")
    config_class = CONFIG_MAPPING[model_type]
    # to_json_string writes inf / nan as {"__float__": "Infinity"} (GraniteMoeHybrid's time_step_limit); the
    # JSON of an index is read back with transformers' own decoder of that encoding, as from_pretrained reads it
    return config_class.from_dict(config_class._decode_special_floats(data))


def shape_problems(
    saved: dict[str, TensorEntry], wanted: dict[str, Sequence[int]], saved_as: str, wanted_as: str
) -> list[str]:
    """Why ``saved`` cannot fill the ``wanted`` tensors (name -> full shape): "missing [names]" and, for up to
    five, "<name>: <saved_as> [shape] vs <wanted_as> [shape]". Empty when every wanted tensor is saved whole."""
    missing = [name for name in wanted if name not in saved]
    wrong = [f"{name}: {saved_as} {list(saved[name].shape)} vs {wanted_as} {list(shape)}"
             for name, shape in wanted.items() if name in saved and saved[name].shape != tuple(shape)]
    problems = [f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else []
    return problems + wrong[:5]


def write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and ``os.replace`` (never half-written)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


@dataclass(frozen=True)
class CheckpointPaths:
    root: Path  # checkpoint-<step>/
    shards: Path  # checkpoint-<step>/shards/
    url: str | None = None  # a checkpoint in a store: root is its local copy, whose shard files come when first read
    files: str | None = None  # ... and the URL its files are under (store.committed_files)

    @property
    def where(self) -> str:
        """The checkpoint as the user named it: its URL in a store, not its local copy."""
        return self.url or str(self.root)

    def locate(self, name: str) -> str:
        """Shard file ``name`` as the user finds it, for messages: the store's object, not its local copy."""
        return store.join(self.files, SHARDS, name) if self.files else str(self.shards / name)

    def shard(self, name: str) -> Path:
        """The local path of shard file ``name``, fetched from the store first where it is not here yet."""
        path = self.shards / name
        if self.files is not None and not path.is_file():
            try:
                store.download(store.join(self.files, SHARDS, name), path)
            except FileNotFoundError:  # the reader names it as missing
                pass
        return path


def resolve(path: str | os.PathLike) -> CheckpointPaths:
    """Accept a checkpoint directory or its shard folder (``shards/``), or a checkpoint's URL in a store (read from
    its local copy, ``store.fetch``)."""
    if store.is_url(path):
        url = str(path).rstrip("/").removesuffix(f"/{SHARDS}")
        state = store.committed(url)
        if state is None:
            raise CheckpointError(f"checkpoint {url} does not exist")
        if not state:
            found = list_checkpoints(url)
            if found:  # a run's URL, as a folder of checkpoints is on a disk
                names = [found_url.rsplit("/", 1)[-1] for found_url in found]
                raise CheckpointError(f"{url} is not a plait checkpoint (no {store.COMMIT} object); it holds "
                                      f"checkpoints {names}, pass one of them")
            raise CheckpointError(f"checkpoint {url} has no commit object: its save never finished")
        local, files = store.fetch(url, SHARDS, INDEX)  # all but the tensor files, which a rank fetches as it reads
        return CheckpointPaths(local, local / SHARDS, url, files)
    path = Path(path)
    root = path.parent if path.name == SHARDS else path
    if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+\.tmp", root.name):  # as a store's checkpoint without its commit object
        raise CheckpointError(f"checkpoint {root} is a save that never finished (a checkpoint loses .tmp when every "
                              f"rank has written it); use a finished checkpoint-N")
    if (path / INDEX).is_file():
        return CheckpointPaths(root, path)
    if (path / SHARDS / INDEX).is_file():
        return CheckpointPaths(path, path / SHARDS)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    found = list_checkpoints(path)
    hint = f"; it holds checkpoints {[p.name for p in found]}, pass one of them" if found else ""
    raise CheckpointError(f"{path} is not a plait checkpoint (no {SHARDS}/{INDEX} or {INDEX}){hint}")


def read_index(path: str | os.PathLike) -> tuple[CheckpointPaths, Index]:
    """Locate and parse a checkpoint's index; CheckpointError naming the file for anything malformed."""
    paths = resolve(path)
    file = paths.locate(INDEX)  # named as the user finds it
    try:
        data = json.loads((paths.shards / INDEX).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the checkpoint is damaged") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"{file} is not a plait checkpoint index (format {found!r}, expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {data.get('version')}; this plait reads version {VERSION}")
    try:
        return paths, Index.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file} is malformed ({type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------------------------------
# Rotation: checkpoint-<step> folders under an output directory
# --------------------------------------------------------------------------------------------------


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path | str:
    """Where the checkpoint of ``step`` goes: ``<output_dir>/checkpoint-<step>`` (Hugging Face's naming; a URL under
    a URL)."""
    if store.is_url(output_dir):
        return store.join(str(output_dir), f"{CHECKPOINT_PREFIX}{step}")
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}"


def should_save(step: int, save_steps: int) -> bool:
    """True at every ``save_steps``-th optimizer step (never when save_steps <= 0)."""
    return save_steps > 0 and step > 0 and step % save_steps == 0


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path] | list[str]:
    """Complete checkpoints under ``output_dir``, oldest step first (temporary folders, and in a store checkpoints
    without their commit object, are ignored)."""
    if store.is_url(output_dir):
        return [url for _, url in store.checkpoints(str(output_dir), CHECKPOINT_PREFIX)]
    found = []
    for child in Path(output_dir).iterdir() if Path(output_dir).is_dir() else []:
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", child.name)
        if match and (child / SHARDS / INDEX).is_file():
            found.append((int(match.group(1)), child))
    return [p for _, p in sorted(found)]


def remove_partial_checkpoints(output_dir: str | os.PathLike) -> list[Path] | list[str]:
    """Delete ``checkpoint-N.tmp`` folders (in a store, checkpoints without their commit object, and what a committed
    one holds beside its own files: ``store.leftovers``): saves a killed job never finished (``list_checkpoints``
    and the readers already ignore them). Call on one rank, at start-up, before this job saves anything."""
    if store.is_url(output_dir):
        doomed = [url for _, url in store.checkpoints(str(output_dir), CHECKPOINT_PREFIX, committed=False)]
        doomed += [leftover for url in list_checkpoints(output_dir) for leftover in store.leftovers(url)]
        for url in doomed:
            store.remove(url)
        return doomed
    doomed = [child for child in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*.tmp")
              if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+\.tmp", child.name) and child.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | str | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None, rank: int = 0) -> list[Path]:
    """Delete the oldest checkpoints beyond ``save_total_limit`` (rank 0 deletes; others return [])."""
    if not save_total_limit or save_total_limit < 1 or rank != 0:
        return []
    found = list_checkpoints(output_dir)
    doomed = found[: max(0, len(found) - save_total_limit)]
    for path in doomed:
        store.remove(path) if store.is_url(path) else shutil.rmtree(path)
    return doomed
