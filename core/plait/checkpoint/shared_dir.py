"""Every rank must see one output directory: checkpoints are written by every rank into it.

A multi-node run whose --output_dir is node-local (a path on each node's own disk) would train until its first
save and then fail, each node holding part of a checkpoint. So before the first step rank 0 writes a marker
file there, every rank looks for it, and a rank that cannot see it is named (with its host) in one line: the
fix is a directory on a file system every node mounts.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import torch.distributed as dist

from plait.base import comm
from plait.base.config import ConfigError


def check_shared_dir(folder: Path, flag: str = "--output_dir") -> None:
    """Refuse ``folder`` unless every rank of the world sees what rank 0 writes there (a collective: every rank
    calls it; the same error on every rank)."""
    world = comm.world_group()
    if not dist.is_initialized() or comm.group_size(world) == 1:
        return
    folder.mkdir(parents=True, exist_ok=True)
    token = comm.all_gather_object(uuid.uuid4().hex, world)[0]  # rank 0's: one name for everyone
    marker = folder / f".plait-shared-{token}"
    rank = dist.get_rank()
    if rank == 0:
        marker.write_text(socket.gethostname())
    comm.barrier(world)
    seen = comm.all_gather_object((marker.exists(), socket.gethostname()), world)
    if rank == 0:
        marker.unlink()
    blind = [(r, host) for r, (found, host) in enumerate(seen) if not found]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise ConfigError(
            f"{flag} {folder} is not one directory for every rank: rank{'s' if len(blind) > 1 else ''} "
            f"{', '.join(str(r) for r, _ in blind)} (on {', '.join(hosts)}) do{'es' if len(blind) == 1 else ''} not "
            f"see the file rank 0 (on {seen[0][1]}) wrote there; every rank writes its part of each checkpoint into "
            f"it, so give a directory on a file system every node mounts (NFS, Lustre, a shared volume)")
