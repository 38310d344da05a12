"""Every LoRA update of this process off for a while: the frozen base model's forward, as peft's
``disable_adapter()`` gives it (DPO's reference under LoRA: the base, with no second copy of it).

A process-wide switch rather than a flag per module: one rank runs every pipeline stage it holds in the same
process, and the forward that reads the switch (a hook, an experts module's weight update) runs inside the caller's
``with`` block, never later (the reference is read without autograd: nothing is recomputed in a backward)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_off = 0


@contextmanager
def adapters_off() -> Iterator[None]:
    """Within the block, every LoRA-adapted module computes as its frozen base."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def active() -> bool:
    """Whether LoRA updates are applied now."""
    return _off == 0
