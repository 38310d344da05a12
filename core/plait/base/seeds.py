"""Seeds for drawing initial weights: one per (run seed, parameter name, row block), the same in every process.

Random init (``plait.checkpoint.materialize``) and LoRA's initial adapters (``plait.lora.layers``) both draw a parameter's
full logical tensor from generators seeded here, then keep their slice, so every layout starts from the same
weights. It sits below both so that neither imports the other.
"""

from __future__ import annotations

import hashlib


def init_seed(seed: int, name: str, block: int | None = None) -> int:
    """A 63-bit seed from (seed, parameter name, row block): stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
