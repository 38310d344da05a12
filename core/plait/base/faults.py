"""Fault injection, a testing aid: make one rank fail on purpose, to prove the job never hangs or loses data.

``PLAIT_FAULT_INJECT="RANK:STEP[:KIND[:PHASE]]"`` makes global rank RANK misbehave at optimizer step STEP
(1-based, as in metrics.jsonl; ``FIRST-LAST`` for each step of a range). KIND is ``raise`` (default: a
RuntimeError naming the fault), ``sleep`` (block
for ``PLAIT_FAULT_SLEEP`` seconds, default 3600, so its peers wait in the next collective until --ddp_timeout
ends them), ``stop`` (SIGSTOP itself: a process that stops responding, as on a frozen host), ``kill`` (SIGKILL
itself, as an out-of-memory killer would) or ``nan`` (a NaN written into this rank's gradients after the step's
backward, as a diverging run or a bad batch on one rank makes them: the non-finite guard must stop every rank
alike, whatever the CPU's kernels do with an extreme learning rate). PHASE is where: ``step`` (default: at the
start of the step; ``nan`` after its backward), ``write`` (while saving that step's checkpoint, before this rank
writes its files: with --save_async in the background, the next steps running) or ``save`` (after this rank wrote
its files and before the checkpoint is complete). A fault fires in the first attempt only
(TORCHELASTIC_RESTART_COUNT unset or 0), so a job torchrun restarts runs clean. Unset, it costs one environment
lookup per call. The trainer calls ``maybe_inject`` at the start of each step and, with the gradients, after its
backward, and the checkpoint writer twice per save; nothing else does.
"""

from __future__ import annotations

import os
import signal
import time

from collections.abc import Sequence

import torch

from plait.base.config import ConfigError

ENV = "PLAIT_FAULT_INJECT"
KINDS = ("raise", "sleep", "stop", "kill", "nan")
PHASES = ("step", "write", "save")


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault throws; its text names the rank and step."""


def maybe_inject(step: int, phase: str = "step", params: Sequence[torch.Tensor] | None = None) -> None:
    """Misbehave as ``PLAIT_FAULT_INJECT`` asks, if it names this rank, ``step`` and ``phase``; else do nothing.
    ``params``: this rank's trainable parameters after the step's backward, into whose first gradient a ``nan``
    fault writes its NaN (a call without them never fires one; a call with them fires nothing else)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":")
    steps = parts[1].split("-", 1) if len(parts) > 1 else []
    if (len(parts) not in (2, 3, 4) or not parts[0].isdigit() or not all(s.isdigit() for s in steps)
            or parts[2:3] and parts[2] not in KINDS or parts[3:4] and parts[3] not in PHASES):
        raise ConfigError(f"{ENV}={spec!r} is not RANK:STEP[:KIND[:PHASE]] (STEP a number or FIRST-LAST) with KIND "
                          f"one of {', '.join(KINDS)} and PHASE one of {', '.join(PHASES)}")
    rank, first, last = int(parts[0]), int(steps[0]), int(steps[-1])
    kind, at_phase = (parts[2:3] or ["raise"])[0], (parts[3:4] or ["step"])[0]
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if rank != int(os.environ.get("RANK", "0")) or not first <= step <= last or phase != at_phase or restarted:
        return
    if (kind == "nan") != (params is not None):
        return
    if kind == "nan":
        _poison(params)
        return
    if kind == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV}={spec})")
    if kind == "sleep":
        time.sleep(float(os.environ.get("PLAIT_FAULT_SLEEP", "3600")))
    else:
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)


def _poison(params: Sequence[torch.Tensor]) -> None:
    """A NaN in the first element of this rank's first non-empty gradient: the fp32 accumulator of a parameter with
    master weights (``main_grad``), else ``grad`` (under ZeRO-2/3 FSDP2's sharded DTensor: its local rows)."""
    for param in params:
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local is not None and local.numel():
            local.view(-1)[0] = float("nan")
            return
    raise RuntimeError(f"{ENV}: this rank has no gradient to write a NaN into")
