"""Process start-up: which device and backend, and the torch.distributed world torchrun describes.

Nothing here names a device type: the device and backend come from flags, and ``auto`` asks ``plait.base.device``
(the accelerator torch finds and torch.distributed's default backend for it, else cpu + gloo), so XLA or a
PrivateUse1 backend can be named instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from plait.base import comm
from plait.base.config import ConfigError, FaultError
from plait.base.device import default_backend, set_device
from plait.base.device import pick_device as pick_device  # its older home: plait.run.runtime.pick_device still works
from plait.run.heartbeat import Heartbeat


def init_distributed(device: torch.device, backend: str, timeout_s: int) -> bool:
    """Join the world torchrun started (WORLD_SIZE > 1, or any torchrun world with PLAIT_SINGLETON_GROUPS=1);
    return whether it is distributed. ``backend="auto"``: torch.distributed's default for the device's type."""
    wanted = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (comm.singleton_groups() and "RANK" in os.environ)
    if not wanted or dist.is_initialized():
        return dist.is_initialized()
    if backend == "auto":
        try:
            backend = default_backend(device)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend, timeout=timeout)
        return True
    # After torchrun restarted the job, the store can still hold the killed attempt's gloo addresses; a
    # fresh key prefix per attempt keeps ranks from connecting to those (gloo connectFullMesh: refused).
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"plait/attempt_{restart}", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    return True


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# Set by plait's own launcher (plait.run.torchrun, ``--nproc_per_node``) in its workers' environment: the folder
# each worker writes its one error line to.
ERROR_DIR = "PLAIT_ERROR_DIR"


def under_plait_launcher() -> bool:
    """Whether this process is a worker of plait's own launcher, which checked the run and read its data before
    any worker started (a torchrun the user started checks nothing first)."""
    return ERROR_DIR in os.environ


def reports_data() -> bool:
    """Whether this process says what data it read: one per node (local rank 0), and none of the workers of
    plait's launcher, which said it once before starting them."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0 and not under_plait_launcher()


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm was not finite (more often than --skip_nonfinite_steps allows); raised
    on every rank at the same step, before the step is applied or anything is saved."""


class CollectiveTimeout(FaultError):
    """A collective waited longer than --ddp_timeout, or lost a peer: another rank is stuck or dead."""


# What gloo and NCCL say when a collective lost its peer (the peer's process died or closed its sockets)
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")


@contextlib.contextmanager
def explain_timeouts(timeout_s: int, heartbeat: Heartbeat | None = None) -> Iterator[None]:
    """Re-raise a backend's collective timeout (gloo: "Timed out waiting ...") or lost peer as one line that names
    the rank waited for (host, pid, step, phase: ``plait.run.heartbeat``) where it can be told, and the flag.

    The backend's own text stays attached as the cause, so nothing is hidden.
    """
    try:
        yield
    except RuntimeError as err:
        text = str(err).lower()
        lost = any(sign in text for sign in PEER_LOST)
        if isinstance(err, CollectiveTimeout) or not (lost or "timed out" in text):
            raise
        culprit = heartbeat.culprit() if heartbeat is not None else None
        if lost:
            what = "a collective lost its connection to another rank"
            hint = "it died or was killed"
        else:
            what = f"a collective waited longer than --ddp_timeout={timeout_s}s"
            hint = "if steps are legitimately this slow, raise --ddp_timeout"
        if culprit:
            raise CollectiveTimeout(f"{culprit}: {what} for it; {hint}") from err
        raise CollectiveTimeout(f"{what}: another rank is stuck or has died (see its output above); {hint}") from err
