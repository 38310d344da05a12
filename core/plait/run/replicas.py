"""Replica groups on torchft: data-parallel replicas that keep training when another one dies.

``plait train --fault_tolerance torchft --replica_group_id K --num_replica_groups R`` runs this job as replica
group K of R. Each group is a job of its own (its own torchrun, store and process group, any plait layout inside:
tp, pp, cp, ep, dp), and the groups together are one data-parallel run: each trains on its share of every global
batch, and after each step's backward every rank averages its gradients with the same rank of the other groups
through torchft's ``Manager`` (a gloo process group that torchft rebuilds whenever the set of live groups
changes), coordinated by the lighthouse at ``TORCHFT_LIGHTHOUSE``, as torchft documents.

A step counts only when its quorum commits it (``should_commit``: every live group finished it); otherwise no
group applies it. When a group dies, the others go on at the next quorum without it, no restart; its share of
the data for the steps it misses is not trained on (torchft's semantics). A group started again joins the next
quorum and, being behind, takes the weights, optimizer and scheduler state, sampler and step from a live peer
(torchft's checkpoint transport) before its first step, so every group holds the same weights from then on.

What torchft cannot carry here is refused by name before training: ZeRO (its sharded optimizer state is laid
out over a group's own ranks, and ZeRO-1's state dict is a collective of its own).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from plait.base.config import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def check_fault_tolerance(mode: str, group_id: int, groups: int, zero: bool) -> None:
    """Refuse a replica-group setup that cannot run, in one line, before anything starts."""
    if mode == "none":
        if groups != 1 or group_id != 0:
            raise ConfigError(f"--replica_group_id {group_id} --num_replica_groups {groups} need --fault_tolerance "
                              f"torchft")
        return
    if not 0 <= group_id < groups:
        raise ConfigError(f"--replica_group_id {group_id} is not one of the {groups} groups of --num_replica_groups "
                          f"(0 to {groups - 1})")
    if not os.environ.get(LIGHTHOUSE_ENV):
        raise ConfigError(f"--fault_tolerance torchft needs the lighthouse's address in {LIGHTHOUSE_ENV} (e.g. "
                          f"http://host:29510; start one with torchft_lighthouse --min_replicas 1)")
    if zero:
        raise ConfigError("--fault_tolerance torchft averages each rank's whole gradients across replica groups and "
                          "hands a live group's optimizer state to a rejoining one: not with ZeRO (--zero_stage / "
                          "--zero_1), whose state is sharded over a group's own ranks; drop ZeRO inside the groups")
    try:
        import torchft  # noqa: F401  (the extra's package, imported here only to name it when missing)
    except ImportError:
        raise ConfigError("--fault_tolerance torchft needs torchft: pip install 'plait[ft]'") from None


class ReplicaGroups:
    """This rank's member of the replica groups: the quorum at each step's start, the gradients averaged over the
    live groups, the commit; ``state`` and ``load`` are what a rejoining group takes from a live one."""

    def __init__(self, group_id: int, rank: int, world_size: int, timeout_s: int,
                 state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at INFO
        import torchft
        import torch.distributed as dist

        if not os.environ.get("PLAIT_DEBUG"):  # a failed peer is expected here: plait says so in one line
            logging.getLogger("torchft").setLevel(logging.CRITICAL)
        timeout = datetime.timedelta(seconds=timeout_s)
        address = port = None
        self._own_store = None
        if not dist.is_initialized():  # a one-process group has no store of its own, which torchft's manager needs
            self._own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            address, port = "127.0.0.1", self._own_store.port
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=state,
            min_replica_size=1, use_async_quorum=False, replica_id=f"plait_{group_id}", rank=rank,
            world_size=world_size, store_addr=address, store_port=port, timeout=timeout, quorum_timeout=timeout,
            lighthouse_addr=os.environ[LIGHTHOUSE_ENV])

    def start_step(self) -> None:
        """The quorum of this step: waits for the live groups; a group behind them takes a live one's state here."""
        self.manager.start_quorum()

    def average(self, params: list[torch.Tensor]) -> None:
        """Average each gradient with the same rank of every live group (a failed peer makes the step uncommitted:
        ``commit`` then says so)."""
        from plait.parallel.grad_sync import grad_of  # FSDP's import: not for the CLI, which imports this module

        works = [self.manager.allreduce(grad) for grad in map(grad_of, params) if grad is not None]
        for work in works:
            work.wait()

    def commit(self) -> bool:
        """Whether every live group finished this step, so that each applies it."""
        return self.manager.should_commit()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def join_replica_groups(trainer: Any) -> ReplicaGroups:
    """This rank's ``ReplicaGroups`` for ``trainer`` (a ``plait.run.trainer.Trainer``): what a live group hands a
    rejoining one is the trainer's whole state at the quorum (weights as this rank holds them, optimizer with its
    masters, scheduler, sampler, counters and the step about to run); loading it sets ``trainer.healed_step``."""
    from plait.parallel.fsdp import local

    named = list(trainer.pmodel.module.named_parameters())
    args = trainer.args

    def state() -> dict[str, Any]:
        return {"step": trainer.loop_step, "params": {name: local(p).detach() for name, p in named},
                "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
                "sampler": trainer.sampler.state_dict(), "counters": [trainer.skipped_steps, trainer.empty_steps]}

    def load(saved: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, param in named:
                local(param).copy_(saved["params"][name])
        trainer.optimizer.load_state_dict(saved["optimizer"])
        trainer.scheduler.load_state_dict(saved["scheduler"])
        trainer.sampler.load_state_dict(saved["sampler"])
        trainer.skipped_steps, trainer.empty_steps = saved["counters"]
        trainer.healed_step = saved["step"]

    mesh = trainer.mesh
    return ReplicaGroups(args.replica_group_id, mesh.rank, mesh.world_size, args.ddp_timeout, state, load)
