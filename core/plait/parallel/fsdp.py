"""ZeRO-2 and ZeRO-3 on torch's FSDP2 (``fully_shard``), over the data-parallel (dp x cp) ranks of a laid-out model.

plait's own TP layers and pipeline stages come first; FSDP2 then shards whatever each rank holds (its tp/ep shard,
its pipeline stage) along dim 0 over the replica group, as torchtitan composes FSDP2 with TP and PP. Each leaf
module (decoder layer) is one FSDP unit, gathered for its forward and backward, and so are the input embedding and
the output head (``edge_units``: in the root unit they stayed gathered for the whole step, their gradients whole
until its end); the model itself holds the rest (the final norm, tied embeddings). The sharded parameters are
DTensors; every plait mechanism that reads them (gradient sums over tp and the pipeline ends, the global norm,
clipping, checkpoints, materialising) works on their local rows, which ``ShardSpec.rows`` places in the logical
tensor.

- Stage 3: parameters are freed after each unit's forward and gathered again for its backward (torch prefetches
  the next unit's gather during compute); no rank holds more than its shard plus the units in flight. The head
  stays gathered from its forward to its backward, which follows at once, and an embedding is not gathered for its
  backward, which never reads its table (``gathered_once``).
- Stage 2: parameters stay gathered from a unit's forward to the end of the step's last backward (no re-gather in
  backward nor per microbatch), gradients are reduce-scattered after each backward into the sharded gradient;
  between steps only the shards exist. (FSDP2 keeps the fp32 shard beside the gathered copy: see
  docs/decisions.md for the bytes this costs against ZeRO-2 as DeepSpeed defines it.)

Gradients are summed, not averaged (plait's losses are already normalised by the global token count):
``set_gradient_divide_factor(1)`` with sum-only collectives, which gloo and NCCL both run.
With ``mixed_precision`` the shards (the master weights) stay fp32, units gather bf16 copies, and gradients are
reduced in fp32 (``MixedPrecisionPolicy``).

On the CPU (gloo) the buffers FSDP2 gathers into and reduce-scatters from are mapped outside malloc's heap
(``plait.base.host_memory.mapped_empty``) and the collectives run in place on them (``HostAllGather``,
``HostReduceScatter``; the sharded gradients they produce stay in the heap). In the heap these unit-sized blocks,
allocated and freed unit after unit, left holes that small objects pinned, and gloo's all-gather and reduce-scatter
each copied the whole buffer once more: a ZeRO-3 rank's resident memory grew above ZeRO-1's, step after step
(docs/design-notes.md, "ZeRO-3's memory on the CPU").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor

from plait.base import comm
from plait.base.device import current_device
from plait.base.host_memory import mapped_empty
from plait.tp.layers import VocabParallelEmbedding
from plait.tp.sharding import ShardSpec


ROOT = ""  # the unit of the parameters under no leaf module: the model's own (embeddings, final norm, head)


def unit_of(name: str, units: Iterable[str]) -> str:
    """The FSDP2 unit holding parameter ``name``: the leaf module (of ``units``) it is under, else ``ROOT``."""
    return next((unit for unit in units if name.startswith(unit + ".")), ROOT)


def _edges(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """{"embedding": (name, module), "head": (name, module)}: transformers' ``get_input_embeddings`` and
    ``get_output_embeddings``, where the model has them (not the root itself)."""
    named = {id(m): n for n, m in model.named_modules() if n}
    found = {}
    for role, getter in (("embedding", "get_input_embeddings"), ("head", "get_output_embeddings")):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        if module is not None and id(module) in named:
            found[role] = (named[id(module)], module)
    return found


def edge_units(model: nn.Module, leaves: Iterable[str]) -> tuple[str, ...]:
    """The input embedding and the output head as FSDP2 units of their own beside the ``leaves``, by module name:
    in the model's root unit they would stay gathered from the step's first forward to its last backward and their
    gradients whole until the root's reduce-scatter at its end. Either stays in the root where it shares a
    parameter with another module (tied embeddings) or lies in or around a leaf."""
    leaves = tuple(leaves)
    found = []
    for name, module in _edges(model).values():
        if any(name == u or name.startswith(u + ".") or u.startswith(name + ".") for u in leaves) or name in found:
            continue
        own = {id(p) for p in module.parameters()}
        inside = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in own]
        if own and all(n.startswith(name + ".") for n in inside):
            found.append(name)
    return tuple(found)


def gathered_once(model: nn.Module, units: Iterable[str]) -> dict[str, str]:
    """{unit name: "head" or "embedding"}: the units ZeRO-3 gathers once per micro-batch, not twice. The output
    head stays gathered from its forward to its backward, which follows at once (what FSDP2 does for its root);
    an input embedding that only looks rows up (``nn.Embedding``, plait's vocab-parallel one) is not gathered for
    its backward, which never reads the table (FSDP2's ``set_unshard_in_backward``, meant for embeddings)."""
    units = set(units)
    found = {}
    for role, (name, module) in _edges(model).items():
        lookup = isinstance(module, (nn.Embedding, VocabParallelEmbedding)) and \
            [n for n, _ in module.named_parameters()] == ["weight"]
        if name in units and (role == "head" or lookup):
            found[name] = role
    return found


def row_range(rows: int, size: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a tensor's ``rows`` that rank ``rank`` of ``size`` stores: torch.chunk over dim 0,
    as FSDP2's ``Shard(0)`` does (ceil(rows / size) per rank, the last ones shorter or empty)."""
    chunk = -(-rows // size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


@dataclass
class AppliedFSDP:
    """What ``apply_fsdp`` did: the FSDP units (experts', leaves, the model last), the replica group the dense
    parameters are sharded over, and under expert parallelism the experts modules and their own group."""

    stage: int
    units: list[FSDPModule] = field(default_factory=list)
    group: dist.ProcessGroup | None = None
    experts: tuple[str, ...] = ()  # the routed-experts modules (expert parallelism), sharded over expert_group
    expert_group: dist.ProcessGroup | None = None

    def group_of(self, name: str) -> dist.ProcessGroup | None:
        """The group parameter ``name``'s rows are spread over: the expert-replica group for an expert
        parameter (the other ranks of the replica group hold other experts), else the replica group."""
        return self.expert_group if any(name.startswith(m + ".") for m in self.experts) else self.group

    def rows(self, name: str, spec: ShardSpec) -> ShardSpec:
        """``spec`` (parameter ``name``'s tp/ep shard) cut to the rows FSDP2 gives this rank (``row_range``)."""
        if not spec.local_shape:
            return spec
        group = self.group_of(name)
        return spec.with_rows(*row_range(spec.local_shape[0], dist.get_world_size(group), dist.get_rank(group)))

    def gather_rows(self, name: str, rows: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """The whole tp/ep shard of parameter ``name`` from every rank's ``rows`` of it (``spec``: this rank's
        rows), for tools that export full tensors (``plait.checkpoint.gather``), never for training."""
        group = self.group_of(name)
        n = spec.unsharded.local_shape[0]
        chunk = row_range(n, dist.get_world_size(group), 0)[1]  # every rank's rows padded to the first rank's
        padded = rows.new_zeros((chunk, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        return comm.all_gather(padded, group, dim=0)[:n]

    def reshard(self) -> None:
        """Every unit's shards back as the module's parameters, the gathered copies freed. FSDP2 reshards after a
        backward, but after a forward that no backward follows (``eval_loss``, ``generate``, a user's forward
        under ``torch.no_grad``) it leaves the root unit (stage 2: every unit; stage 3 also the head, gathered once)
        gathered, with the gathered tensors as the module's parameters: an optimizer built then would step those
        instead of the shards, and a checkpoint would find them (measured before this: stage 2 then never
        trained; tests/workers/optim_parity.py)."""
        for unit in self.units:
            unit.reshard()

    def keep_gathered(self, keep: bool) -> None:
        """Stage 2 between the microbatches of a step: ``True`` keeps parameters gathered after a backward (the
        next microbatch's forward needs them), ``False`` before the step's last backward frees them after it."""
        if self.stage == 2:
            for unit in self.units:
                unit.set_reshard_after_backward(not keep, recurse=False)


def reshard(fsdp: AppliedFSDP | None) -> None:
    """``fsdp.reshard()`` under ZeRO-2/3; nothing without (``fsdp`` None)."""
    if fsdp is not None:
        fsdp.reshard()


def apply_fsdp(
    model: nn.Module, leaves: Iterable[str], group: dist.ProcessGroup, stage: int, mixed_precision: bool,
    experts: Iterable[str] = (), expert_group: dist.ProcessGroup | None = None,
) -> AppliedFSDP:
    """Shard ``model`` (this rank's tp/pp part) over ``group`` with FSDP2: each of ``leaves`` (decoder layers, and
    the embedding and head: ``edge_units``) one unit, the model the root unit; under stage 3 the head and embedding
    gathered once per micro-batch (``gathered_once``). Under expert parallelism each of ``experts`` (routed-experts
    modules, inside the leaves) is a unit of its own over ``expert_group`` (the ranks holding the same experts),
    as torchtitan shards experts: the leaf's unit then holds the rest of its layer. Replaces every parameter with
    a DTensor parameter (``remap_params`` finds the new ones)."""
    leaves, experts = list(leaves), tuple(experts)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    placed = [(model.get_submodule(name), expert_group) for name in experts]  # inner units first
    placed += [(model.get_submodule(name), group) for name in leaves] + [(model, group)]
    meshes = {}
    for unit, over in placed:
        if id(over) not in meshes:
            meshes[id(over)] = DeviceMesh.from_group(over, current_device().type)
        fully_shard(unit, mesh=meshes[id(over)], reshard_after_forward=stage == 3, mp_policy=policy)
    once = gathered_once(model, leaves) if stage == 3 else {}
    for name in leaves:
        if once.get(name) == "head":
            model.get_submodule(name).set_reshard_after_forward(False)
        elif once.get(name) == "embedding":
            model.get_submodule(name).set_unshard_in_backward(False)
    for unit, over in placed:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        if current_device().type == "cpu":
            unit.set_custom_all_gather(HostAllGather())
            unit.set_custom_reduce_scatter(HostReduceScatter(dist.get_world_size(over)))
    return AppliedFSDP(stage, [unit for unit, _ in placed], group, experts, expert_group)


class HostAllGather(AllGather):
    """FSDP2's all-gather on the CPU: into a buffer outside malloc's heap (``mapped_empty``), in place: FSDP2 has
    copied this rank's rows into its own slot of the buffer, and each rank's slot is broadcast from that rank
    (gloo's ``all_gather_into_tensor`` gathers into a copy of the whole buffer and copies it out). Issued on
    FSDP2's behalf, so ``plait.base.comm`` does not count them, as it did not count FSDP2's own."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return mapped_empty(math.prod(int(n) for n in size), dtype).view(*size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        rows = input_tensor.numel()
        for rank in range(dist.get_world_size(group)):
            dist.broadcast(output_tensor.narrow(0, rank * rows, rows), group_src=rank, group=group)
        return None  # done: FSDP2 waits for nothing


class HostReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter on the CPU: from a buffer outside malloc's heap (``mapped_empty``), each rank's slot
    summed into that rank in place (``reduce``; the other ranks' slots are scratch) and copied into its output.
    gloo's ``reduce_scatter_tensor`` all-reduces a copy of the whole buffer; summing the same values, two ranks get
    the same bits either way (``a + b``). The output becomes the unit's sharded gradient and lives until the
    optimizer step: it stays in the heap, where a step's freed activations leave room for it (mapped, it would add
    its pages to theirs at the end of the backward)."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.source = world_size, 0  # the numel of the buffer just allocated to reduce from

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(n) for n in size)
        if self.source and numel * self.world_size == self.source:  # FSDP2 asks for the source, then the output
            self.source = 0
            return torch.empty(*size, dtype=dtype, device=device)
        self.source = numel
        return mapped_empty(numel, dtype).view(*size)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> None:
        rows = output_tensor.numel()
        for rank in range(dist.get_world_size(group)):
            dist.reduce(input_tensor.narrow(0, rank * rows, rows), group_dst=rank, op=op, group=group)
        output_tensor.copy_(input_tensor.narrow(0, dist.get_rank(group) * rows, rows))
        return None


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


def remap_params(before: dict[str, nn.Parameter], model: nn.Module) -> dict[int, nn.Parameter]:
    """{id of a parameter before ``apply_fsdp``: its replacement}, matched by name (``before``: names to
    parameters, duplicates included, taken before sharding)."""
    after = dict(model.named_parameters(remove_duplicate=False))
    return {id(param): after[name] for name, param in before.items()}
