"""Mesh: the tp / cp / pp / dp process groups of one torchrun world, built once and passed explicitly.

Ranks are laid out as ``torch.arange(world).view(dp, pp, cp, tp)`` (picotron's grid with Megatron's cp next
to tp; ``DIMS``, outermost first): tp ranks are adjacent, then cp ranks, so the chattiest groups share a node. Each
dimension's group is the ranks that differ along it alone (``ranks_along``), so a new dimension is one entry of
``DIMS`` (its size a field of ``ParallelConfig``, its rank and group fields here). The ranks of one dp
replica's cp group hold the same parameters and different parts of each sequence, so gradients are summed,
and ZeRO shards optimizer state, over the ``replica_group`` (dp x cp); the batch is split over dp only.

Expert parallelism is carved out of the replica ranks, as in torchtitan and Megatron: each (pp, tp) position's
dp x cp ranks, in order (dp major), form consecutive ``ep_group``s of ep ranks that divide each MoE layer's
experts; the ranks holding the same experts (one per ep group) form the ``expert_replica_group`` (dp x cp / ep),
over which expert gradients are summed and expert optimizer state is sharded.

A world of one process (no torch.distributed) is a valid mesh whose groups are all None; every collective in
``plait.base.comm`` is the identity on such a group.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.base import comm
from plait.base.config import ParallelConfig

ProcessGroup = dist.ProcessGroup

# The mesh's dimensions, outermost first: each is a ParallelConfig size with a ``{name}_rank`` and a
# ``{name}_group`` on Mesh.
DIMS = ("dp", "pp", "cp", "tp")


def ranks_along(grid: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
    """The ranks of ``grid`` (shaped as ``DIMS``) in rows that differ along the dimensions ``names`` alone, one
    row per position of the others; within a row the last of ``names`` varies fastest."""
    along = [DIMS.index(name) for name in names]
    others = [i for i in range(len(DIMS)) if i not in along]
    return grid.permute(*others, *along).reshape(-1, math.prod(grid.shape[i] for i in along))


def grid_of(config: ParallelConfig, world_size: int) -> torch.Tensor:
    """Every rank at its place in the mesh: ``arange(world_size)`` shaped as ``DIMS`` (``config`` resolved)."""
    return torch.arange(world_size).view(*(getattr(config, name) for name in DIMS))


@dataclass
class Mesh:
    """This rank's coordinates and groups. Build it with ``Mesh.from_world(config)``."""

    config: ParallelConfig
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0
    tp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    cp_group: ProcessGroup | None = None
    replica_group: ProcessGroup | None = None  # dp x cp: every rank holding this rank's parameters
    ep_rank: int = 0
    ep_group: ProcessGroup | None = None  # ranks dividing the experts of each MoE layer (carved from dp x cp)
    expert_replica_group: ProcessGroup | None = None  # dp x cp / ep: every rank holding this rank's experts
    _tp_blocks: dict[int, ProcessGroup | None] = field(default_factory=dict, repr=False)
    _ends: tuple[ProcessGroup | None] | None = field(default=None, repr=False)
    # How long a collective on one of these groups may wait. torch gives every new_group() its own default
    # (30 minutes for gloo), not the timeout the world was initialised with, so it is passed on here.
    timeout: datetime.timedelta | None = field(default=None, repr=False)

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def dp(self) -> int:
        assert self.config.dp is not None
        return self.config.dp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def ep(self) -> int:
        return self.config.ep

    def _grid(self) -> torch.Tensor:
        return grid_of(self.config, self.world_size)

    @classmethod
    def from_world(cls, config: ParallelConfig, timeout: datetime.timedelta | None = None) -> "Mesh":
        """Resolve ``config`` against the running world and create every group (all ranks must call this).

        ``timeout``: bounds every collective on these groups (the trainer passes --ddp_timeout); None keeps
        torch's default for new groups."""
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if distributed else 1
        rank = dist.get_rank() if distributed else 0
        config = config.resolve(world_size)
        grid = grid_of(config, world_size)
        at = dict(zip(DIMS, (int(c) for c in (grid == rank).nonzero()[0])))
        ep_i = (at["dp"] * config.cp + at["cp"]) % config.ep  # position in the replica ranks' order, dp major
        mesh = cls(config, rank, world_size, **{f"{name}_rank": at[name] for name in DIMS}, ep_rank=ep_i,
                   timeout=timeout)
        if distributed:
            for name in DIMS:
                setattr(mesh, f"{name}_group", _new_groups(ranks_along(grid, (name,)), rank, timeout))
            if config.cp > 1:
                mesh.replica_group = _new_groups(ranks_along(grid, ("dp", "cp")), rank, timeout)
            if config.ep > 1:
                replicas = ranks_along(grid, ("dp", "cp")).reshape(-1, config.dp * config.cp // config.ep, config.ep)
                mesh.ep_group = _new_groups(replicas.reshape(-1, config.ep), rank, timeout)
                # under ZeRO-2/3 a group even of one rank: FSDP2 shards the experts over a mesh of it
                mesh.expert_replica_group = _new_groups(replicas.transpose(1, 2).reshape(-1, replicas.shape[1]),
                                                        rank, timeout, single=config.fsdp)
        if config.cp == 1:
            mesh.replica_group = mesh.dp_group
        if config.ep == 1:
            mesh.expert_replica_group = mesh.replica_group
        return mesh

    def tp_block_group(self, block: int) -> ProcessGroup | None:
        """The group of ``block`` adjacent tp ranks containing this rank (e.g. ranks sharing a kv head).

        Every rank must ask for the same block sizes in the same order, as with any ``new_group``.
        """
        if block not in self._tp_blocks:
            if self.tp_group is None or block == 1:
                self._tp_blocks[block] = None
            else:
                grid = torch.arange(self.world_size).view(-1, block)
                self._tp_blocks[block] = _new_groups(grid, self.rank, self.timeout)
        return self._tp_blocks[block]

    def pipeline_ends_group(self) -> ProcessGroup | None:
        """The group of the first and last pipeline ranks sharing this rank's (dp, tp) coordinates.

        Tied embeddings live on both pipeline ends (the input embedding on the first stage, the LM head on
        the last); their gradients are summed over this group. Every rank must call it (``new_group`` is
        collective); ranks in the middle of the pipeline get None.
        """
        if self._ends is None:
            if self.world_size == 1 or self.pp == 1:
                self._ends = (None,)
            else:
                ends = ranks_along(self._grid()[:, [0, self.pp - 1]], ("pp",))
                group = _new_groups(ends, self.rank, self.timeout)
                self._ends = (group if self.pp_rank in (0, self.pp - 1) else None,)
        return self._ends[0]

    def __str__(self) -> str:
        cp = f" cp {self.cp_rank}/{self.cp}" if self.cp > 1 else ""
        cp += f" ep {self.ep_rank}/{self.ep}" if self.ep > 1 else ""
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp}{cp} "
            f"pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp}"
        )


def _new_groups(
    rows: torch.Tensor, rank: int, timeout: datetime.timedelta | None, single: bool = False,
) -> ProcessGroup | None:
    """Create one group per row (collectively) and return the one holding ``rank``; None for 1-rank rows
    (unless ``single`` or ``comm.singleton_groups()``: a real group of one, on which ``comm.trivial`` still holds
    unless the latter)."""
    mine = None
    for row in rows.tolist():
        if len(row) == 1 and not (single or comm.singleton_groups()):
            return None
        group = dist.new_group(row, timeout=timeout)
        if rank in row:
            mine = group
    return mine
