"""Fault injection, a testing aid: make one rank fail on purpose, to prove the job never hangs or loses data.

``PLAIT_FAULT_INJECT="RANK:STEP[:KIND[:PHASE]]"`` makes global rank RANK misbehave at optimizer step STEP
(1-based, as in metrics.jsonl). KIND is ``raise`` (default: a RuntimeError naming the fault), ``sleep`` (block
for ``PLAIT_FAULT_SLEEP`` seconds, default 3600, so its peers wait in the next collective until --ddp_timeout
ends them), ``stop`` (SIGSTOP itself: a process that stops responding, as on a frozen host) or ``kill`` (SIGKILL
itself, as an out-of-memory killer would). PHASE is where: ``step`` (default: at the start of the step) or
``save`` (while saving that step's checkpoint, after this rank wrote its files and before the checkpoint is
complete). A fault fires in the first attempt only (TORCHELASTIC_RESTART_COUNT unset or 0), so a job torchrun
restarts runs clean. Unset, it costs one environment lookup per call. The trainer calls ``maybe_inject`` once per
step and the checkpoint writer once per save; nothing else does.
"""

from __future__ import annotations

import os
import signal
import time

from plait.config import ConfigError

ENV = "PLAIT_FAULT_INJECT"
KINDS = ("raise", "sleep", "stop", "kill")
PHASES = ("step", "save")


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault throws; its text names the rank and step."""


def maybe_inject(step: int, phase: str = "step") -> None:
    """Misbehave as ``PLAIT_FAULT_INJECT`` asks, if it names this rank, ``step`` and ``phase``; else do nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":")
    if (len(parts) not in (2, 3, 4) or not parts[0].isdigit() or not parts[1].isdigit()
            or parts[2:3] and parts[2] not in KINDS or parts[3:4] and parts[3] not in PHASES):
        raise ConfigError(f"{ENV}={spec!r} is not RANK:STEP[:KIND[:PHASE]] with KIND one of {', '.join(KINDS)} "
                          f"and PHASE one of {', '.join(PHASES)}")
    rank, at_step = int(parts[0]), int(parts[1])
    kind, at_phase = (parts[2:3] or ["raise"])[0], (parts[3:4] or ["step"])[0]
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if rank != int(os.environ.get("RANK", "0")) or step != at_step or phase != at_phase or restarted:
        return
    if kind == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV}={spec})")
    if kind == "sleep":
        time.sleep(float(os.environ.get("PLAIT_FAULT_SLEEP", "3600")))
    else:
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
