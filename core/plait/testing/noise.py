"""Which fp32 misses of the conformance kit may be reordering noise, and so are decided again in float64.

A layout sums in another order than one process; in fp32 that differs by ~1e-7 relative, and Adam (eps 1e-6)
amplifies it step by step in some tiny models, past the kit's tolerance by step 2 or 3 (gemma3_text, mixtral,
olmo2 under tp here; OPT's embeddings at tp=2 with SP on an AVX-512 Xeon, 31x at step 3, where this machine's
AVX2 kernels stayed within it). Which pairs that happens to depends on the CPU's kernels, so no list of pairs can
hold it: the shape of the miss decides. A miss in gradients only, with every loss right, after step 1, or at step
1 within ``STEP1_NOISE`` times the tolerance (Gemma 4: one process in fp32 is 2.6x the tolerance off its own float64
gradient at step 1), is run again in float64, where that noise shrinks 20-300x while a mis-split module stays off
by 1e-4 or more (10x the tolerance and more at step 1): the float64 result is the verdict. The kit's callers
(``run_conformance``, the pytest fixture, ``plait check-adapter``, the architecture sweep) all use this rule, and so
do the suite's own parity workers (``noise_shaped``, on their lists of failures).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Protocol

from plait.testing.conformance_modes import LOSS_RTOL

GRAD_MISS = re.compile(r"step (\d+) grad [^;]*\(([0-9.e+-]+)x tolerance\)")  # "step 2 grad w: ... (1.3x tolerance)"
STEP1_NOISE = 10.0  # a step-1 gradient this many tolerances off, or fewer, may be fp32 noise: float64 decides


class Outcome(Protocol):
    """What the rule reads of a kit result (``conformance.ModeResult``)."""

    status: str
    note: str
    loss_rel: float | None
    grad_tol: float | None
    dtype: str


def tolerances(note: str, step: int) -> list[float]:
    """The multiples of the tolerance a kit note gives for ``step``'s gradients, in order ("step 1 grad w: max |Δ|
    4.95e-06 (2.2e+00x tolerance); ...")."""
    return [float(x) for x in re.findall(rf"step {step} grad [^;]*?\(([0-9.e+-]+)x tolerance\)", note)]


def fp32_noise(result: Outcome) -> bool:
    """True for an fp32 failure shaped like reordering noise (the module docstring): float64 must decide it."""
    if result.status != "FAIL" or result.dtype != "float32":
        return False
    first = result.note.lstrip()
    if result.loss_rel is None or result.loss_rel > LOSS_RTOL or result.grad_tol is None:
        return False
    if re.match(r"step [2-9] grad", first):  # ZeRO-2/3 modes run 4 steps
        return True
    return first.startswith("step 1 grad") and max(tolerances(first, step=1), default=math.inf) <= STEP1_NOISE


def noise_note(note: str) -> str:
    """Where the fp32 gradients left the tolerance: 'step 1 within tolerance, step 2 grad X over it', or at step 1
    'step 1 grad X 2.2x the tolerance'."""
    first = note.lstrip()
    if first.startswith("step 1 grad"):
        return f"{first.split(':')[0]} {tolerances(first, step=1)[0]:.1f}x the tolerance"
    return f"step 1 within tolerance, {first.split(':')[0]} over it"


def noise_shaped(failures: Sequence[str]) -> bool:
    """``fp32_noise`` for a list of fp32 failures gathered over a world's ranks: every one a gradient over its
    tolerance (no loss, no missing gradient), the first after step 1 or at step 1 within ``STEP1_NOISE`` times the
    tolerance. Such a case is run again in float64, which decides."""
    found = [GRAD_MISS.match(failure) for failure in failures]
    if not found or not all(found):
        return False
    first = min(int(match.group(1)) for match in found)
    return first > 1 or max(float(match.group(2)) for match in found if match.group(1) == "1") <= STEP1_NOISE
