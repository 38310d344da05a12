"""What a rank saves besides bytes: its parameters and optimizer state as boxes of logical tensors, its RNG
states, and JSON-safe copies of optimizer hyperparameters and scheduler state.

Optimizers own their checkpoint state. An optimizer object may define

* ``plait_state(names, specs) -> (list[LocalTensor], meta)``: the state this rank holds, each tensor with
  the boxes of its logical tensor (``optimizer/<param>/<key>``) it covers; a dp slice of a flattened
  parameter is described with ``format.flat_range_boxes`` (several local tensors may share a logical name).
  ``meta`` is JSON: ``class`` (the update rule, e.g. "AdamW" also under ZeRO-1, so that a checkpoint moves
  between ZeRO and plain optimizers), ``groups`` (hyperparameters), ``membership`` (parameter -> group) and
  ``state`` (per parameter, each state key: ``"tensor"`` or a JSON value), as ``torch_optimizer_state``.
* ``plait_plan_load(names, specs, meta, entries) -> (reads, finish)``: the boxes it needs (``ReadOp``) and a
  callable run after they are filled that installs the state.

``names`` maps each model parameter to its logical name, ``specs`` each name to its ``ShardSpec``. Wrappers
build on the functions here: ``plait.optim.Zero1Optimizer`` saves through its per-rank optimizer
(``optimizer_state`` / ``plan_optimizer_load`` of the inner one), ``plait.optim.MasterWeightOptimizer`` adds
its fp32 masters (``optimizer/<param>/master``) to ``torch_optimizer_state`` of its inner optimizer.

Plain ``torch.optim`` optimizers (AdamW, SGD ...) need neither method: their per-parameter state tensors have
the parameter's local shape and follow its ``ShardSpec``; 0-d tensors (``step``) are replicated. torch's own
``ZeroRedundancyOptimizer`` is not one of them (its ``state_dict`` needs a consolidation on one rank): use
``plait.optim.Zero1Optimizer``.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.base.device import accelerator as device_accelerator
from plait.checkpoint.format import Box, CheckpointError, TensorEntry, full_box, spec_boxes
from plait.checkpoint.st_io import DTYPES
from plait.parallel.fsdp import local
from plait.tp.sharding import ShardSpec


@dataclass
class LocalTensor:
    """A tensor this rank holds: ``boxes`` lists (box of the logical tensor, start of the box in ``tensor``)."""

    logical: str
    kind: str  # "param" or "optim"
    full_shape: tuple[int, ...]
    tensor: torch.Tensor
    boxes: list[tuple[Box, tuple[int, ...]]]


@dataclass
class ReadOp:
    """Fill ``out`` (a view into a local tensor) with ``box`` of logical tensor ``logical``."""

    logical: str
    box: Box
    out: torch.Tensor


@dataclass
class LocalParams:
    """This rank's parameters and their specs by canonical name, the aliases (tied name -> canonical), and its
    persistent buffers by name (replicated: see ``persistent_buffers``)."""

    params: dict[str, nn.Parameter]
    specs: dict[str, ShardSpec]
    aliases: dict[str, str]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every tensor of the model's state: parameters, then persistent buffers."""
        return {**{n: tuple(s.full_shape) for n, s in self.specs.items()},
                **{n: tuple(b.shape) for n, b in self.buffers.items()}}


def local_params(module: nn.Module, specs: dict[str, ShardSpec] | None = None) -> LocalParams:
    """This rank's parameters by canonical name (``specs``: the model's, by local name; None: replicated).

    Tied weights are one logical tensor under transformers' source name (GPT2: ``transformer.wte.weight``,
    not ``lm_head.weight``), the name ``save_pretrained`` keeps. A pipeline stage that holds only the head
    of a tied pair holds that same logical tensor: saved once, seeded the same, loaded from the same bytes.
    """
    aliases = dict(getattr(module, "all_tied_weights_keys", None) or {})
    found = LocalParams({}, {}, aliases, persistent_buffers(module))
    for name, param in module.named_parameters():
        canonical = aliases.get(name, name)
        found.params[canonical] = param
        found.specs[canonical] = specs[name] if specs is not None else ShardSpec(tuple(param.shape))
    return found


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers in ``module``'s ``state_dict`` (DeepSeek-V3's router ``e_score_correction_bias``): model
    state that ``save_pretrained`` writes and ``from_pretrained`` reads, so checkpoints carry them too. No
    tensor-parallel rule splits a buffer, so each is whole (replicated) on every rank that holds its module;
    non-persistent ones (rotary ``inv_freq``) are recomputed instead (``materialize.materialize_buffers``)."""
    found = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def param_tensors(params: dict[str, nn.Parameter], specs: dict[str, ShardSpec]) -> list[LocalTensor]:
    return [LocalTensor(name, "param", specs[name].full_shape, local(p).detach(), spec_boxes(specs[name]))
            for name, p in params.items()]


def buffer_tensors(buffers: dict[str, torch.Tensor]) -> list[LocalTensor]:
    """Persistent buffers as whole (replicated) model tensors: saved once, by the lowest rank holding each."""
    return param_tensors(buffers, {name: ShardSpec(tuple(b.shape)) for name, b in buffers.items()})


def local_views(spec: ShardSpec, tensor: torch.Tensor, logical: str) -> list[ReadOp]:
    """Read operations filling ``tensor`` (laid out like ``spec``'s local shard) from ``logical``."""
    reads = []
    for box, at in spec_boxes(spec):
        view = tensor
        for d, ((a, b), start) in enumerate(zip(box, at)):
            view = view.narrow(d, start, b - a)
        reads.append(ReadOp(logical, box, view))
    return reads


# --------------------------------------------------------------------------------------------------
# Optimizer state
# --------------------------------------------------------------------------------------------------


def param_name(names: dict[nn.Parameter, str], param: torch.Tensor, optimizer: Any) -> str:
    """The logical name of ``param``; CheckpointError when ``optimizer`` steps a tensor the model does not hold."""
    if param not in names:
        raise CheckpointError(
            f"{type(optimizer).__name__} steps a tensor of shape {list(param.shape)} that is not a parameter of the "
            f"model (fp32 master weights?); such an optimizer must define plait_state / plait_plan_load "
            f"(see plait.checkpoint.state)"
        )
    return names[param]


def optimizer_key(param: str, key: str) -> str:
    """The logical name of state ``key`` of parameter ``param``."""
    return f"optimizer/{param}/{key}"


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its parameters: what a checkpoint keeps of it."""
    return {k: v for k, v in group.items() if k != "params"}


def optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec]
) -> tuple[list[LocalTensor], dict[str, Any]]:
    """This rank's optimizer state as boxes of logical tensors, plus its JSON part: the optimizer's own
    ``plait_state`` when it has one, else ``torch_optimizer_state``."""
    if hasattr(optimizer, "plait_state"):
        return optimizer.plait_state(names, specs)
    return torch_optimizer_state(optimizer, names, specs)


def torch_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec]
) -> tuple[list[LocalTensor], dict[str, Any]]:
    """The default for ``torch.optim`` optimizers: state tensors follow their parameter's spec."""
    state_dict = optimizer.state_dict()
    tensors: list[LocalTensor] = []
    groups, membership, keys = [], {}, {}
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, state_dict["param_groups"])):
        groups.append(to_json(hyperparameters(saved)))
        for param, index in zip(group["params"], saved["params"]):
            name = param_name(names, param, optimizer)
            membership[name] = g
            spec = specs[name]
            keys[name] = {}
            for key, value in state_dict["state"].get(index, {}).items():
                if not isinstance(value, torch.Tensor):
                    keys[name][key] = to_json(value)
                    continue
                keys[name][key] = "tensor"
                if value.dim() == 0:
                    tensors.append(LocalTensor(optimizer_key(name, key), "optim", (), value, [((), ())]))
                elif tuple(value.shape) == tuple(param.shape):
                    tensors.append(LocalTensor(optimizer_key(name, key), "optim", spec.full_shape, value,
                                               spec_boxes(spec)))
                else:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {name} has shape {list(value.shape)}, neither a scalar nor the "
                        f"parameter's local shape {list(param.shape)}; plait cannot shard it "
                        f"({type(optimizer).__name__})"
                    )
    meta = {"class": type(optimizer).__name__, "groups": groups, "membership": membership, "state": keys}
    return tensors, meta


def merge_optimizer_meta(metas: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One optimizer description from several holding different parameters with the same groups (ranks of
    different pipeline stages or ep ranks; the two parts of ``ExpertZero1Optimizer``)."""
    present = [m for m in metas if m is not None]
    if not present:
        return None
    merged = {**present[0], "membership": {}, "state": {}}
    for meta in present:
        merged["membership"].update(meta["membership"])
        merged["state"].update(meta["state"])
    return merged


def plan_optimizer_load(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec],
    meta: dict[str, Any], entries: dict[str, TensorEntry],
) -> tuple[list[ReadOp], Callable[[], None]]:
    """Check the saved state fits ``optimizer`` and return the reads that fill it plus the installer: the
    optimizer's own ``plait_plan_load`` when it has one, else ``torch_load_plan`` and ``load_state_dict``."""
    if hasattr(optimizer, "plait_plan_load"):
        return optimizer.plait_plan_load(names, specs, meta, entries)
    reads, state_dict = torch_load_plan(optimizer, names, specs, meta, entries)
    return reads, lambda: optimizer.load_state_dict(state_dict)


def torch_load_plan(
    optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], specs: dict[str, ShardSpec], meta: dict[str, Any],
    entries: dict[str, TensorEntry],
) -> tuple[list[ReadOp], dict[str, Any]]:
    """The reads and the ``load_state_dict`` argument (filled by the reads) of a ``torch.optim`` optimizer."""
    if meta["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint optimizer is {meta['class']}, this run uses {type(optimizer).__name__}; "
            f"use the same optimizer to resume, or load the weights only (optimizer=None)"
        )
    if len(meta["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint optimizer has {len(meta['groups'])} param groups, this optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    reads: list[ReadOp] = []
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        groups.append({**from_json(meta["groups"][g]), "params": list(range(index, index + len(group["params"])))})
        for param in group["params"]:
            name = param_name(names, param, optimizer)
            if name not in meta["membership"]:
                raise CheckpointError(f"checkpoint has no optimizer entry for parameter {name}")
            if meta["membership"][name] != g:
                raise CheckpointError(
                    f"parameter {name} is in param group {g} here but in group {meta['membership'][name]} "
                    f"in the checkpoint"
                )
            spec = specs[name]
            param_state: dict[str, Any] = {}
            for key, kind in meta["state"].get(name, {}).items():
                logical = optimizer_key(name, key)
                if kind != "tensor":
                    param_state[key] = from_json(kind)
                    continue
                entry = entries.get(logical)
                if entry is None:
                    raise CheckpointError(f"optimizer state tensor {logical} is listed but has no saved pieces")
                if entry.shape == ():
                    out = torch.empty((), dtype=DTYPES[entry.dtype])
                    reads.append(ReadOp(logical, full_box(()), out))
                elif entry.shape == tuple(spec.full_shape):
                    out = torch.zeros(param.shape, dtype=DTYPES[entry.dtype])
                    reads += local_views(spec, out, logical)
                else:
                    raise CheckpointError(
                        f"optimizer state {logical} has full shape {list(entry.shape)} but parameter {name} has "
                        f"{list(spec.full_shape)}"
                    )
                param_state[key] = out
            if param_state:
                state[index] = param_state
            index += 1
    return reads, {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------------------------------
# JSON-safe state (optimizer hyperparameters, scheduler) and RNG
# --------------------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """Plain JSON for optimizer/scheduler state; tuples become lists, tensors tagged dicts."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot save state value {value!r} of type {type(value).__name__} (not JSON-serialisable)")


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    return to_json(scheduler.state_dict())


def load_scheduler_state(scheduler: Any, state: dict[str, Any]) -> None:
    scheduler.load_state_dict(from_json(state))


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and accelerator RNG states of this process, as JSON."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": _b64(torch.get_rng_state())}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    except ImportError:
        pass
    accelerator = device_accelerator()
    if accelerator is not None:
        module = torch.get_device_module(accelerator.type)
        if hasattr(module, "get_rng_state_all"):
            state["device"] = {"type": accelerator.type, "states": [_b64(s) for s in module.get_rng_state_all()]}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    device = state.get("device")
    if device and torch.accelerator.is_available():
        module = torch.get_device_module(device["type"])
        if hasattr(module, "set_rng_state_all"):
            module.set_rng_state_all([_unb64(s) for s in device["states"]])
