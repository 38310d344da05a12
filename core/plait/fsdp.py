"""ZeRO-2 and ZeRO-3 on torch's FSDP2 (``fully_shard``), over the data-parallel (dp x cp) ranks of a laid-out model.

plait's own TP layers and pipeline stages come first; FSDP2 then shards whatever each rank holds (its tp/ep shard,
its pipeline stage) along dim 0 over the replica group, as torchtitan composes FSDP2 with TP and PP. Each leaf
module (decoder layer) is one FSDP unit, gathered for its forward and backward, and the model itself holds the
rest (embeddings, final norm, head). The sharded parameters are DTensors; every plait mechanism that reads them
(gradient sums over tp and the pipeline ends, the global norm, clipping, checkpoints, materialising) works on
their local rows, which ``ShardSpec.rows`` places in the logical tensor.

- Stage 3: parameters are freed after each unit's forward and gathered again for its backward (torch prefetches
  the next unit's gather during compute); no rank holds more than its shard plus the units in flight.
- Stage 2: parameters stay gathered from a unit's forward to the end of the step's last backward (no re-gather in
  backward nor per microbatch), gradients are reduce-scattered after each backward into the sharded gradient;
  between steps only the shards exist. (FSDP2 keeps the fp32 shard beside the gathered copy: see
  docs/decisions.md for the bytes this costs against ZeRO-2 as DeepSpeed defines it.)

Gradients are summed, not averaged (plait's losses are already normalised by the global token count):
``set_gradient_divide_factor(1)`` with sum-only collectives, which gloo and NCCL both run.
With ``mixed_precision`` the shards (the master weights) stay fp32, units gather bf16 copies, and gradients are
reduced in fp32 (``MixedPrecisionPolicy``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable_state import _insert_module_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from plait import comm
from plait.device import current_device
from plait.tp.sharding import ShardSpec


ROOT = ""  # the unit of the parameters under no leaf module: the model's own (embeddings, final norm, head)


def unit_of(name: str, units: Iterable[str]) -> str:
    """The FSDP2 unit holding parameter ``name``: the leaf module (of ``units``) it is under, else ``ROOT``."""
    return next((unit for unit in units if name.startswith(unit + ".")), ROOT)


def row_range(rows: int, size: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a tensor's ``rows`` that rank ``rank`` of ``size`` stores: torch.chunk over dim 0,
    as FSDP2's ``Shard(0)`` does (ceil(rows / size) per rank, the last ones shorter or empty)."""
    chunk = -(-rows // size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


@dataclass
class AppliedFSDP:
    """What ``apply_fsdp`` did: the FSDP units (leaves first, the model last) and the dp rank and size."""

    stage: int
    units: list[FSDPModule] = field(default_factory=list)
    rank: int = 0
    size: int = 1

    def rows(self, spec: ShardSpec) -> ShardSpec:
        """``spec`` (a parameter's tp/ep shard) cut to the rows FSDP2 gives this rank (``row_range``)."""
        if not spec.local_shape:
            return spec
        return spec.with_rows(*row_range(spec.local_shape[0], self.size, self.rank))

    def gather_rows(self, rows: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> torch.Tensor:
        """The whole tp/ep shard from every rank's ``rows`` of it (``spec``: this rank's rows), for tools that
        export full tensors (``plait.gather``), never for training."""
        n = spec.unsharded.local_shape[0]
        chunk = row_range(n, self.size, 0)[1]  # every rank's rows padded to the first rank's
        padded = rows.new_zeros((chunk, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        return comm.all_gather(padded, group, dim=0)[:n]

    def keep_gathered(self, keep: bool) -> None:
        """Stage 2 between the microbatches of a step: ``True`` keeps parameters gathered after a backward (the
        next microbatch's forward needs them), ``False`` before the step's last backward frees them after it."""
        if self.stage == 2:
            for unit in self.units:
                unit.set_reshard_after_backward(not keep, recurse=False)


def apply_fsdp(
    model: nn.Module, leaves: Iterable[str], group: dist.ProcessGroup, stage: int, mixed_precision: bool,
) -> AppliedFSDP:
    """Shard ``model`` (this rank's tp/pp part) over ``group`` with FSDP2: each leaf module one unit, the model
    the root unit. Replaces every parameter with a DTensor parameter (``remap_params`` finds the new ones)."""
    mesh = DeviceMesh.from_group(group, current_device().type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    units = [model.get_submodule(name) for name in leaves] + [model]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=policy)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return AppliedFSDP(stage, units, dist.get_rank(group), dist.get_world_size(group))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local rows (the same storage), anything else itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def install_local(param: nn.Parameter, rows: torch.Tensor) -> None:
    """Give a meta DTensor parameter of an FSDP unit its local rows (``materialize``), in place (every module and
    FSDP2 itself keep the same parameter object); ``reset_storage`` after."""
    spec = param._spec
    real = DTensor.from_local(rows, spec.mesh, spec.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)
    torch.utils.swap_tensors(param, nn.Parameter(real, requires_grad=param.requires_grad))


def reset_storage(model: nn.Module) -> None:
    """Let FSDP2 take up local rows installed with ``install_local`` (it pads them into its own flat storage),
    what ``nn.Module.to_empty`` has it do after moving parameters."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    fsdp_param.reset_sharded_param()


def share_state(unit: nn.Module, copied: nn.Module) -> None:
    """Let a shallow copy of an FSDP unit (a pipeline stage's shell of the model, ``pipeline.stages.shell``) run as
    that unit: torch finds a unit's state by module object, so the copy is registered under the same state."""
    if isinstance(unit, FSDPModule):
        _insert_module_state(copied, unit._get_fsdp_state())


def remap_params(before: dict[str, nn.Parameter], model: nn.Module) -> dict[int, nn.Parameter]:
    """{id of a parameter before ``apply_fsdp``: its replacement}, matched by name (``before``: names to
    parameters, duplicates included, taken before sharding)."""
    after = dict(model.named_parameters(remove_duplicate=False))
    return {id(param): after[name] for name, param in before.items()}
