"""A Hugging Face model directory read as a checkpoint.

config.json plus model.safetensors (or the shards that model.safetensors.index.json names) is an index in
which every tensor is one piece covering its full box. So one reader (``load.CheckpointReader``) serves
both: a rank reads exactly the bytes of its slices, whether a plait checkpoint or a model directory holds
them. Only the names differ: a model directory holds tensors in the original format transformers converts on
load (per-expert MoE weights, which the model holds stacked: ``hf_conversion``), may store a tied weight under
its other name, and hub GPT2 files leave out the base model prefix (``h.0.attn...`` for
``transformer.h.0.attn...``), so the index is renamed to the model's parameter names before anything is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Container, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping

from plait.base.config import ConfigError
from plait.checkpoint.format import CheckpointPaths, Index, Piece, TensorEntry, full_box, shape_problems
from plait.checkpoint.hf_conversion import converted
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.st_io import NAMES, SafetensorsError, SafetensorsFile

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def open_hf_dir(
    path: str | os.PathLike, model: PreTrainedModel, shapes: dict[str, Sequence[int]], aliases: dict[str, str],
    optional: dict[str, Sequence[int]] | None = None,
) -> CheckpointReader:
    """A reader of the model directory ``path`` with its tensors under the names of ``model`` (converted as
    ``from_pretrained`` converts them; ``shapes``: this rank's parameters and their full shapes; ``aliases``: as
    ``hf_names``). ``optional``: more tensors (persistent buffers) it holds where the directory has them; like
    ``from_pretrained``, a buffer a directory lacks keeps the value the model initialises it with. ConfigError
    naming the missing and mis-shaped tensors, before any is read."""
    paths, index = read_hf_index(path)
    optional = optional or {}
    names, base_prefix = [*shapes, *optional], model.base_model_prefix
    with original_classes(model):
        transforms = get_model_conversion_mapping(model)
    index = converted(index, transforms, names, base_prefix)
    index = hf_names(index, names, aliases, base_prefix)
    present = {name: shape for name, shape in optional.items() if name in index.tensors}
    problems = shape_problems(index.params(), {**shapes, **present}, "file", "model")
    if problems:
        raise ConfigError(f"{path} does not match its config.json: {'; '.join(problems)}")
    return CheckpointReader(paths, index)


@contextlib.contextmanager
def original_classes(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s modules under their own classes while inside: ZeRO-2/3's FSDP renames a module's class
    (``FSDPLlavaForConditionalGeneration``), and transformers looks up a model's checkpoint conversions by class name
    first (LLaVA's ``language_model.lm_head`` -> ``lm_head`` is listed under its class only)."""
    swapped = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            own = next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))
            swapped.append((module, type(module)))
            module.__class__ = own
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def read_hf_index(path: str | os.PathLike) -> tuple[CheckpointPaths, Index]:
    """The index of the model directory ``path``: its config (as transformers resolves config.json) and one
    full-box piece per stored tensor, under the stored names. The files have no recorded checksums."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    tensors, files = {}, {}
    for file in _weight_files(path):
        header = _open(path / file)
        files[file] = {"size": header.path.stat().st_size}
        for name, stored in header.entries.items():
            box = full_box(stored.shape)
            tensors[name] = TensorEntry("param", NAMES[stored.dtype], stored.shape,
                                        [Piece(file, name, box, (0,) * len(box))])
    index = Index(step=0, model_type=config.model_type, model_config=json.loads(config.to_json_string()),
                  parallel_config={}, world_size=1, tensors=tensors, files=files)
    return CheckpointPaths(path, path), index


def hf_names(index: Index, names: Iterable[str], aliases: dict[str, str], base_prefix: str) -> Index:
    """``index`` with each of the model's parameter ``names`` under the stored tensor that holds it: itself, a
    weight tied to it (``aliases``: tied name -> name) or either without ``base_prefix``. Names no stored
    tensor holds are left out (the caller reports them as missing)."""
    tensors = {}
    for name in names:
        key = _stored_key(index.tensors, name, aliases, base_prefix)
        if key is not None:
            tensors[name] = index.tensors[key]
    return dataclasses.replace(index, tensors=tensors)


def _stored_key(stored: Container[str], name: str, aliases: dict[str, str], base_prefix: str) -> str | None:
    candidates = [name, *(alias for alias, target in aliases.items() if target == name)]
    prefix = f"{base_prefix}." if base_prefix else ""
    candidates += [c.removeprefix(prefix) for c in candidates if prefix and c.startswith(prefix)]
    return next((key for key in candidates if key in stored), None)


def _weight_files(path: Path) -> list[str]:
    """The safetensors files of the model: the shards the shard index names, or the single weights file."""
    if (path / SAFE_INDEX).is_file():
        return sorted(set(json.loads((path / SAFE_INDEX).read_text())["weight_map"].values()))
    if (path / SAFE_WEIGHTS).is_file():
        return [SAFE_WEIGHTS]
    found = sorted(p.name for p in path.iterdir())
    raise ConfigError(
        f"{path} has no {SAFE_WEIGHTS} or {SAFE_INDEX} (found {found}); plait loads safetensors only: "
        f"convert with transformers (from_pretrained, then save_pretrained)"
    )


def _open(path: Path) -> SafetensorsFile:
    """The parsed header of one weights file; ConfigError naming the file when it is missing or damaged."""
    try:
        return SafetensorsFile(path)
    except SafetensorsError as exc:
        raise ConfigError(str(exc)) from None
