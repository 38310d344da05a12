"""SFT examples laid into blocks of ``block_size`` tokens: padded (one example per block) or packed.

An example is its token ids and a per-token "trainable" flag (assistant / completion tokens). Labels are
the ids where trainable, else -100; the first token of every example is -100 too, so that in a packed
block no token is ever predicted from the end of the previous example, and an example's loss is the same
whether padded or packed.

Padded: the example, then pad tokens labelled -100. No attention mask is needed: attention is causal and
the padding comes after the real tokens, so no real token ever sees it, and the padding's own outputs carry
no label. Packed: examples placed by best-fit decreasing (fewest blocks for skewed lengths), with
``position_ids`` restarting at 0 at every example (and for the padding tail); transformers'
``create_causal_mask`` reads those restarts (``find_packed_sequence_indices``, when no attention mask is
given) and builds a block-diagonal causal mask, on every pipeline stage and from the whole sequence under
sequence parallelism (the mask is built before the SP region starts).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plait.data.blocks import TokenBlocks
from plait.tp.loss import IGNORE_INDEX, num_items_in_batch


@dataclass(frozen=True)
class Example:
    """One tokenized example: ``ids`` and ``trainable`` of equal length; ``where`` names its source line."""

    ids: np.ndarray
    trainable: np.ndarray
    where: str


OVERLONG = ("truncate", "drop", "refuse")


@dataclass(frozen=True)
class LayoutCounts:
    """What laying examples into blocks kept and lost, counted after truncation: the numbers a user needs to
    see that ``--block_size`` cut their answers away (trainable tokens are the ones with a label)."""

    examples: int = 0  # examples in the data
    kept: int = 0  # examples in the blocks
    truncated: int = 0  # kept examples cut to --block_size
    dropped: int = 0  # examples skipped: --overlong drop, nothing left to train on
    untrainable: int = 0  # kept examples with no trainable token (truncated away, or none to begin with)
    trainable_kept: int = 0  # trainable tokens (labels) in the blocks
    trainable_lost: int = 0  # trainable tokens cut by truncation or dropped with their example
    longest: int = 0  # tokens of the longest example, before truncation

    @property
    def lost_share(self) -> float:
        total = self.trainable_kept + self.trainable_lost
        return self.trainable_lost / total if total else 0.0


@dataclass
class SFTBlocks:
    """Rows of ``block_size`` tokens: ``input_ids``, ``labels``, and ``position_ids`` when packed (None when
    padded: the default positions are right). Stored as int32, handed out as int64 per batch."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    counts: LayoutCounts
    real_tokens: int  # tokens of examples (after truncation); the rest of the rows is padding

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_examples(self) -> int:
        return self.counts.kept

    @property
    def pad_tokens(self) -> int:
        return self.input_ids.numel() - self.real_tokens


def _labels(example: Example, n: int) -> np.ndarray:
    """The labels of the first ``n`` tokens: the id where trainable, else -100, and -100 at the first token
    (never predicted from the previous example of a packed block)."""
    labels = np.where(example.trainable[:n], example.ids[:n], IGNORE_INDEX)
    labels[:1] = IGNORE_INDEX
    return labels


def lay_out(examples: Sequence[Example], block_size: int, pad_id: int, packing: bool, overlong: str) -> SFTBlocks:
    """Blocks of ``examples``. An example longer than ``block_size`` is cut to its first ``block_size`` tokens
    (``overlong="truncate"``), or refused (``"refuse"``: ValueError naming its line and length); ``"drop"``
    truncates too but skips every example left with no trainable token, which would cost compute and teach
    nothing (TRL's and axolotl's long-sequence filters serve the same end)."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r} is unknown; choose one of {', '.join(OVERLONG)}")
    pieces = []
    counts = dict.fromkeys(("examples", "truncated", "dropped", "untrainable", "trainable_kept", "trainable_lost",
                            "longest"), 0)
    for example in examples:
        n = len(example.ids)
        counts["examples"] += 1
        counts["longest"] = max(counts["longest"], n)
        whole = int((_labels(example, n) != IGNORE_INDEX).sum())
        if n > block_size:
            if overlong == "refuse":
                raise ValueError(f"{example.where}: the example has {n} tokens, more than --block_size={block_size}; "
                                 f"raise --block_size, shorten it, or cut such examples with --overlong truncate")
            n = block_size
        labels = _labels(example, n)
        trainable = int((labels != IGNORE_INDEX).sum())
        if n == 0 or (trainable == 0 and overlong == "drop"):
            counts["dropped"] += 1
            counts["trainable_lost"] += whole
            continue
        counts["truncated"] += n < len(example.ids)
        counts["untrainable"] += trainable == 0
        counts["trainable_kept"] += trainable
        counts["trainable_lost"] += whole - trainable
        pieces.append((example.ids[:n], labels))
    if not pieces:
        raise ValueError(f"no SFT example is left to train on (of {counts['examples']:,}, --overlong {overlong} dropped "
                         f"{counts['dropped']:,}); raise --block_size or check the data")
    rows = _pack(pieces, block_size) if packing else [[i] for i in range(len(pieces))]
    ids = np.full((len(rows), block_size), pad_id, dtype=np.int32)
    labels = np.full((len(rows), block_size), IGNORE_INDEX, dtype=np.int32)
    positions = np.zeros((len(rows), block_size), dtype=np.int32) if packing else None
    real = 0
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            piece_ids, piece_labels = pieces[i]
            n = len(piece_ids)
            ids[r, at:at + n], labels[r, at:at + n] = piece_ids, piece_labels
            if positions is not None:
                positions[r, at:at + n] = np.arange(n)
            at += n
        real += at
        if positions is not None:  # the padding tail is a document of its own: real tokens never see it
            positions[r, at:] = np.arange(block_size - at)
    return SFTBlocks(torch.from_numpy(ids), torch.from_numpy(labels),
                     None if positions is None else torch.from_numpy(positions),
                     LayoutCounts(kept=len(pieces), **counts), real)


def describe_counts(counts: LayoutCounts, block_size: int) -> str:
    """One line of what the blocks hold, after truncation: examples kept, truncated, dropped, and trainable
    tokens kept and lost."""
    parts = [f"{counts.kept:,} of {counts.examples:,} examples kept"]
    if counts.truncated:
        parts.append(f"{counts.truncated:,} truncated to --block_size={block_size}")
    if counts.dropped:
        parts.append(f"{counts.dropped:,} dropped")
    if counts.untrainable:
        parts.append(f"{counts.untrainable:,} with no token left to train on")
    line = ", ".join(parts) + f"; {counts.trainable_kept:,} tokens trained on"
    if counts.trainable_lost:
        line += f", {counts.trainable_lost:,} ({counts.lost_share:.0%}) lost to truncation"
    return line


# A share of trainable tokens lost to truncation above which set-up warns.
LOST_WARNING = 0.1


def truncation_warning(counts: LayoutCounts, block_size: int) -> str | None:
    """A warning when truncation cuts a large share of what there is to train on (None: nothing to say)."""
    if counts.lost_share < LOST_WARNING and not (counts.untrainable and counts.untrainable >= counts.kept * LOST_WARNING):
        return None
    advice = f"raise --block_size (the longest example has {counts.longest:,} tokens)"
    if counts.untrainable:
        advice += f", or skip the {counts.untrainable:,} examples left with nothing to train on with --overlong drop"
    return (f"warning: --block_size={block_size} truncation loses {counts.lost_share:.0%} of the tokens to train on "
            f"({counts.trainable_lost:,} of {counts.trainable_kept + counts.trainable_lost:,}); {advice}")


def _pack(pieces: list[tuple[np.ndarray, np.ndarray]], block_size: int) -> list[list[int]]:
    """Best-fit decreasing: longest first, each into the fullest block it fits in. Deterministic."""
    order = sorted(range(len(pieces)), key=lambda i: (-len(pieces[i][0]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row) sorted: the first with room >= n is the best fit
    for i in order:
        n = len(pieces[i][0])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            row, room = len(rows) - 1, block_size - n
        else:
            room, row = free.pop(at)
            rows[row].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


def batch_inputs(blocks, rows: torch.Tensor, device: torch.device, spans: list[tuple[int, int]] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, position_ids) of ``rows``: SFT blocks, or packed plain-text blocks (labels are the
    ids, positions the default). ``spans``: the token ranges of each block the caller will read (a cp rank's
    slice); a token file then reads only those, the rest of each row is zeros."""
    if isinstance(blocks, SFTBlocks):
        positions = None if blocks.position_ids is None else blocks.position_ids[rows].long().to(device)
        return blocks.input_ids[rows].long().to(device), blocks.labels[rows].long().to(device), positions
    batch = (blocks.read_spans(rows, spans) if spans is not None and isinstance(blocks, TokenBlocks)
             else blocks[rows]).to(device)
    return batch, batch, None


def count_labels(blocks, rows: torch.Tensor) -> int:
    """Tokens with a label (after the causal shift) in ``rows``: the loss's divisor for a global batch, known
    on every rank without communication since every rank knows the global batch's rows. Plain-text blocks:
    every shifted token counts."""
    if isinstance(blocks, SFTBlocks):
        return int(num_items_in_batch(blocks.labels[rows]))
    return len(rows) * (blocks.shape[1] - 1)
