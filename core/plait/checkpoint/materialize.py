"""Build a model no rank ever holds whole: meta build, ``parallelize``, then each rank materialises its shards.

1. The transformers model is built under ``torch.device("meta")`` (shapes only, no memory), as
   optimum-neuron's ``lazy_load_for_parallelism`` and NxD's meta init do.
2. ``parallelize`` swaps in the TP layers; they are created from meta slices, so still no memory.
3. Each rank allocates only its local shards and fills them from a Hugging Face model directory or a plait
   checkpoint (any saved layout), reading only its bytes of each tensor with one reader for both
   (``checkpoint.load.CheckpointReader``; ``checkpoint.hf_dir`` sees a model directory as an index), or by
   seeded random init. Buffers are recomputed by transformers' own ``_init_weights`` (rotary ``inv_freq``);
   persistent ones (model state, e.g. a router's ``e_score_correction_bias``) are then read from the source
   where it has them; tied weights stay one tensor.

Random init is seeded per parameter (and per block of rows) from ``(seed, name)``, then sliced, so the
full logical weights are identical for every layout: tp=1 and tp=4 start from the same model.
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PretrainedConfig

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import build_meta_model
from plait.base.seeds import init_seed
from plait.checkpoint import store
from plait.checkpoint.format import INDEX, SHARDS, full_box, model_config, read_index, resolve
from plait.checkpoint.hf_dir import open_hf_dir, read_hf_index
from plait.checkpoint.load import load_checkpoint
from plait.checkpoint.state import local_params, local_views, persistent_buffers
from plait.lora.base import base_reference, base_source, check_base, saved_lora
from plait.lora.layers import local_init
from plait.parallel.float8 import check_float8_device
from plait.parallel.fsdp import install_local, reset_storage
from plait.parallel_model import ParallelModel
from plait.parallelize import parallelize
from plait.plugin.registry import Adapter, Registry, default_registry
from plait.tp.sharding import ShardSpec

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig


INIT_CHUNK_ELEMENTS = 1 << 22  # rows of a parameter are drawn in blocks of about this many elements


def load_parallel_model(
    source: PretrainedConfig | str | os.PathLike,
    parallel_config: ParallelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    registry: Registry | None = None,
    timeout: datetime.timedelta | None = None,
    lora: LoraConfig | None = None,
) -> ParallelModel:
    """A ParallelModel whose ranks each hold only their shards.

    ``source``: a transformers config (seeded random init), a Hugging Face model directory (config.json plus
    model.safetensors or a sharded model.safetensors.index.json) or a plait checkpoint directory (any
    saved layout). Every rank must call it. Missing or mismatched tensors raise before any weight is read.
    ``timeout`` bounds collectives on the model's process groups (``parallelize``). ``lora``: train LoRA
    adapters on the frozen model (seeded from ``seed``, like random weights).
    """
    registry = registry or default_registry()
    config, kind, path, checkpoint, saved = checkpoint_source(source)
    if saved is not None:  # a LoRA checkpoint holds the adapters; the frozen base comes from its reference
        lora = lora or saved[0]
        check_base(saved[1], str(checkpoint))
        kind, path, seed = base_source(saved[1], seed)
    pmodel = parallelize(build_meta_model(config, dtype), parallel_config, registry=registry, timeout=timeout,
                         lora=lora)
    materialize(pmodel, kind, path, seed=seed, device=device, registry=registry)
    if checkpoint is not None:
        load_checkpoint(checkpoint, pmodel)
    return pmodel


def checkpoint_source(source: PretrainedConfig | str | os.PathLike) -> tuple[PretrainedConfig, str, Path | None,
                                                                              str | Path | None, tuple | None]:
    """``resolve_source``'s config, kind and path, and for a plait checkpoint where its tensors are read and the LoRA
    settings it saved (None: a full checkpoint, or no checkpoint). A checkpoint in a store is read through its URL:
    the local copy holds only what was fetched (its index), and reading from it, the tensor files were missing on a
    machine that had not fetched them (plait generate failed)."""
    config, kind, path = resolve_source(source)
    checkpoint = (str(source) if store.is_url(source) else path) if kind == "checkpoint" else None
    saved = saved_lora(read_index(checkpoint)[1].extra) if checkpoint is not None else None
    return config, kind, path, checkpoint, saved


def materialize_source(pmodel: ParallelModel, source: PretrainedConfig | str | os.PathLike, *, seed: int = 0,
                       device: str | torch.device = "cpu") -> str:
    """``materialize`` from ``source`` (as ``resolve_source`` reads it), a plait checkpoint's weights read in too,
    not its optimizer state: what a run starts from (--model_name_or_path) and a frozen teacher or reference. With
    ``materialize`` alone a checkpoint's parameters were only allocated, for a resume's ``load_checkpoint`` to fill:
    a run, a teacher or a reference from a checkpoint computed with uninitialised memory (NaN at step 1). A LoRA
    checkpoint, adapters beside a reference to their base, is refused. Returns the kind of source."""
    _, kind, path, checkpoint, saved = checkpoint_source(source)
    if saved is not None:
        raise ConfigError(f"{source} is a LoRA checkpoint (adapters and a reference to their base), not a model to "
                          f"start from; resume it with --resume_from_checkpoint, or give the directory `plait "
                          f"consolidate {source} DIR --lora merged` writes")
    materialize(pmodel, kind, path, seed=seed, device=device)
    if checkpoint is not None:
        load_checkpoint(checkpoint, pmodel)
    return kind


def materialize(
    pmodel: ParallelModel, kind: str, path: Path | None, *, seed: int = 0, device: str | torch.device = "cpu",
    registry: Registry | None = None,
) -> None:
    """Give every parameter of a ParallelModel laid out on the meta device its local storage on ``device``.

    ``kind`` (from ``resolve_source``): "init" fills seeded random weights, "hf" reads this rank's slices of
    the model directory ``path``; "checkpoint" only allocates, for ``load_checkpoint`` to fill (together
    with the optimizer state, in one read). Buffers are recomputed.
    """
    registry = registry or default_registry()
    check_float8_device(pmodel.config, device)
    model, config = pmodel.module, pmodel.plan.model_config
    found = local_params(model, pmodel.param_specs)
    lora = pmodel.plan.lora
    adapters = lora.param_names() if lora is not None else set()  # LoRA starts from its own init, not a file
    if lora is not None and kind != "checkpoint":
        pmodel.lora_base = base_reference(kind, path, seed)
    hf = None  # a reader of the model directory, its tensors under the parameters' names
    if kind == "hf":
        shapes = {name: spec.full_shape for name, spec in found.specs.items() if name not in adapters}
        buffers = {name: tuple(b.shape) for name, b in found.buffers.items()}
        hf = open_hf_dir(path, model, shapes, found.aliases, optional=buffers)
    device = torch.device(device)
    materialize_buffers(model, device)
    if hf is not None:  # persistent buffers are model state (a trained router bias): the directory's values
        with torch.no_grad():
            for name, buffer in persistent_buffers(model).items():
                if name in hf.index.tensors:
                    hf.read(name, full_box(tuple(buffer.shape)), buffer)
    init = SeededInit(registry, pmodel.adapter, config, seed) if kind == "init" else None
    with torch.no_grad():
        for name, param in found.params.items():
            spec = found.specs[name]
            local = torch.empty(spec.local_shape, dtype=param.dtype)
            padding = spec.padding(local)
            if padding is not None:
                padding.zero_()
            if name in adapters and kind != "checkpoint":
                local.copy_(local_init(lora, name, spec, seed, param.dtype))
            elif hf is not None:
                for op in local_views(spec, local, name):
                    hf.read(op.logical, op.box, op.out)
            elif init is not None:
                init.fill(name, spec, local)
            if pmodel.fsdp is not None:  # ZeRO-3's local rows of a DTensor parameter
                install_local(param, local.to(device))
            else:
                torch.utils.swap_tensors(param, nn.Parameter(local.to(device), requires_grad=param.requires_grad))
    if pmodel.fsdp is not None:
        reset_storage(model)


def resolve_source(source: PretrainedConfig | str | os.PathLike) -> tuple[PretrainedConfig, str, Path | None]:
    """(config, "init" | "hf" | "checkpoint", directory): a directory's config comes from its index."""
    if isinstance(source, PretrainedConfig):
        return source, "init", None
    path = resolve(source).root if store.is_url(source) else Path(source)  # a checkpoint in a store: its local copy
    if (path / SHARDS / INDEX).is_file() or (path / INDEX).is_file():
        return model_config(read_index(path)[1]), "checkpoint", path
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is neither a model directory (no config.json) nor a plait checkpoint")
    return model_config(read_hf_index(path)[1]), "hf", path


# --------------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------------


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute every meta buffer (rotary ``inv_freq``, GPT-Neo's boolean causal mask) with transformers' own
    ``_init_weights`` (the innermost transformers model's holding the buffer: an image-text model's vision tower is a
    model of its own, whose ``_init_weights`` knows its embeddings where the outer model's does not).

    A buffer that ``_init_weights`` does not recompute must be an error naming it, rather than a model that
    silently computes with garbage. So each is filled with sentinels first: NaN for a floating-point buffer
    (still NaN afterwards: not recomputed); for an integer or boolean one, which has no NaN, 0 and then 1 with
    ``_init_weights`` run after each (not recomputed where the two results differ).
    """
    inits = {name: m._init_weights for name, m in model.named_modules() if hasattr(m, "_init_weights")}
    for module_name, module in model.named_modules():
        metas = {n: b for n, b in module._buffers.items() if b is not None and b.is_meta}
        if not metas:
            continue
        owner = max((name for name in inits if not name or module_name == name or module_name.startswith(name + ".")),
                    key=len, default=None)
        init_weights = None if owner is None else inits[owner]
        exact = any(not b.dtype.is_floating_point for b in metas.values())
        results = []
        for fill in (0, 1) if exact else (math.nan,):
            for name, buffer in metas.items():
                value = math.nan if buffer.dtype.is_floating_point else fill
                module._buffers[name] = torch.full(buffer.shape, value, dtype=buffer.dtype, device=device)
            if init_weights is not None:
                init_weights(module)
            results.append({n: module._buffers[n].clone() if exact else module._buffers[n] for n in metas})
        stale = [n for n in metas if (torch.isnan(results[-1][n]).any() if metas[n].dtype.is_floating_point
                                      else not torch.equal(results[0][n], results[-1][n]))]
        if stale:
            raise ConfigError(
                f"buffers {[f'{module_name}.{n}' for n in stale]} were not recomputed after the meta build "
                f"(transformers' _init_weights does not handle {type(module).__name__})"
            )


# --------------------------------------------------------------------------------------------------
# Seeded random init, identical full weights for every layout
# --------------------------------------------------------------------------------------------------


FALLBACK_STD = 0.02  # transformers' usual initializer_range, for a config without one


def init_fallback_note(registry: Registry, adapter: Adapter, config: PretrainedConfig) -> str | None:
    """What a random init falls back on, said once by the trainer: a config without ``initializer_range`` (OPT
    calls it ``init_std``) whose adapter has no ``plait_init_weight`` gets plait's default std."""
    if registry.implements(adapter, "plait_init_weight") or getattr(config, "initializer_range", None):
        return None
    return (f"{type(config).__name__} has no initializer_range: random init draws matrices from normal(0, "
            f"{FALLBACK_STD}); adapter {adapter.name!r} can implement plait_init_weight for the architecture's own init")


class SeededInit:
    """Fills local shards so that the full logical tensors depend only on (seed, name, full shape).

    The adapter's ``plait_init_weight`` hook, if implemented, gets the full tensor and one generator per
    parameter. plait's default draws rows in fixed blocks (each with its own generator), so a rank draws only
    the blocks its rows fall in and never holds more than one block beyond its shard: normal(0,
    initializer_range) for matrices and embeddings, zeros for biases, ones for other vectors (norm weights).
    """

    def __init__(self, registry: Registry, adapter: Adapter, config: PretrainedConfig, seed: int) -> None:
        self.registry, self.adapter, self.config, self.seed = registry, adapter, config, seed
        self.hook = registry.implements(adapter, "plait_init_weight")
        self.std = getattr(config, "initializer_range", None) or FALLBACK_STD

    def fill(self, name: str, spec: ShardSpec, local: torch.Tensor) -> None:
        if self.hook:
            full = torch.empty(spec.full_shape, dtype=local.dtype)
            generator = torch.Generator().manual_seed(init_seed(self.seed, name))
            if self.registry.init_weight(self.adapter, name=name, tensor=full, config=self.config, generator=generator):
                for op in local_views(spec, local, name):
                    op.out.copy_(full[tuple(slice(a, b) for a, b in op.box)])
                return
            del full
        shape = spec.full_shape
        if len(shape) < 2:
            value = 0.0 if name.endswith("bias") else 1.0
            for op in local_views(spec, local, name):
                op.out.fill_(value)
            return
        ops = local_views(spec, local, name)
        block = max(1, INIT_CHUNK_ELEMENTS // math.prod(shape[1:]))
        wanted = sorted({b for op in ops for b in range(op.box[0][0] // block, (op.box[0][1] - 1) // block + 1)})
        for b in wanted:
            r0, r1 = b * block, min((b + 1) * block, shape[0])
            rows = torch.empty((r1 - r0, *shape[1:]), dtype=torch.float32)
            rows.normal_(0.0, self.std, generator=torch.Generator().manual_seed(init_seed(self.seed, name, b)))
            for op in ops:
                lo, hi = max(r0, op.box[0][0]), min(r1, op.box[0][1])
                if lo < hi:
                    src = rows[(slice(lo - r0, hi - r0), *(slice(a, c) for a, c in op.box[1:]))]
                    op.out[lo - op.box[0][0]: hi - op.box[0][0]].copy_(src)

