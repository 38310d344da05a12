"""Which tokens of a sequence each context-parallel rank holds, and the full-sequence facts its forward needs.

A sequence of S tokens is cut into 2C chunks; cp rank i holds chunks i and 2C-1-i (Megatron's and
torchtitan's load balancing): under a causal mask the early chunk attends to little and the late one to
much, so every rank does the same attention work. Labels are shifted on the whole sequence before it is
cut, so a token whose next token lives on another rank is still scored, once, where it sits.

Everything but attention is per token and runs on the local slice as is. Attention needs the whole
sequence's mask; transformers builds it from the position ids (packed documents restart them) and the
padding mask, so those are kept whole in a ``SequenceContext`` that the mask builders read while the
model runs (plait.cp.masks), and the model itself gets this rank's slices (rotary tables and learned
position embeddings are per token).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch

from plait.base.config import ConfigError

def chunk_bounds(seq: int, size: int, rank: int) -> list[tuple[int, int]]:
    """[start, stop) of the two chunks of a ``seq``-token sequence that cp rank ``rank`` of ``size`` holds."""
    c = seq // (2 * size)
    return [(rank * c, (rank + 1) * c), ((2 * size - 1 - rank) * c, (2 * size - rank) * c)]


def local_index(seq: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions (in the whole sequence) of the tokens cp rank ``rank`` holds, in the order it holds them."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunk_bounds(seq, size, rank)])


def read_spans(seq: int, size: int, rank: int) -> list[tuple[int, int]]:
    """The token ranges of a ``seq``-token block cp rank ``rank`` reads: its two chunks, each with the next
    token (the label of its last one)."""
    return [(a, min(b + 1, seq)) for a, b in chunk_bounds(seq, size, rank)]


def natural_order(seq: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The permutation that puts the ranks' slices, concatenated in rank order, back into sequence order."""
    held = torch.cat([local_index(seq, size, r, device) for r in range(size)])
    return torch.argsort(held)


def check_length(seq: int, size: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse a sequence length that the load-balanced split cannot cut evenly (before any collective)."""
    need = 2 * size * (tp if sequence_parallel else 1)
    if seq % need:
        sp = f" (and by tp={tp} under sequence parallelism)" if sequence_parallel else ""
        raise ConfigError(
            f"sequence length {seq} is not divisible by 2*cp = {2 * size}{sp}; use a block size that is a "
            f"multiple of {need}"
        )


@dataclass
class SequenceContext:
    """The whole-sequence inputs of one forward on a cp rank (shared by every layer and stage of it)."""

    position_ids: torch.Tensor  # [batch, S]
    attention_mask: torch.Tensor | None  # [batch, S] padding mask, or None
    cp: Any  # the plait.cp.context.ContextParallel running the forward

    @property
    def seq(self) -> int:
        return self.position_ids.shape[-1]


_current: contextvars.ContextVar[SequenceContext | None] = contextvars.ContextVar("plait_cp_sequence", default=None)


def current() -> SequenceContext | None:
    """The sequence of the forward running on this rank under context parallelism, or None."""
    return _current.get()


def enter(context: SequenceContext | None) -> contextvars.Token:
    """Make ``context`` the current sequence (until ``leave``); None suspends the current one (an image-text model's
    vision tower inside a cp forward: ``plait.cp.images``)."""
    return _current.set(context)


def leave(token: contextvars.Token) -> None:
    _current.reset(token)
