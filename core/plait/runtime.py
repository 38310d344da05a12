"""Process start-up: which device and backend, and the torch.distributed world torchrun describes.

Nothing here names a device type: the device and backend come from flags, and ``auto`` asks ``plait.device``
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

from plait import comm
from plait.config import ConfigError
from plait.device import default_backend, set_device
from plait.device import pick_device as pick_device  # its older home: plait.runtime.pick_device still works


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


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm was not finite (more often than --skip_nonfinite_steps allows); raised
    on every rank at the same step, before the step is applied or anything is saved."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than --ddp_timeout: a peer rank is stuck or dead."""


@contextlib.contextmanager
def explain_timeouts(timeout_s: int) -> Iterator[None]:
    """Re-raise a backend's collective timeout (gloo: "Timed out waiting ...") as one line naming the flag.

    The backend's own text stays attached as the cause, so nothing is hidden.
    """
    try:
        yield
    except RuntimeError as err:
        if "timed out" not in str(err).lower() or isinstance(err, CollectiveTimeout):
            raise
        raise CollectiveTimeout(
            f"a collective waited longer than --ddp_timeout={timeout_s}s: another rank is stuck or has died (see "
            f"its output above); if steps are legitimately this slow, raise --ddp_timeout"
        ) from err
