"""Shard specs and shard decisions: what a tp rank holds of a tensor and of a module. Pure, no communication.

How one rule splits its modules lives with the rule (``tp/styles/``, built on this module); walking a TP plan
over a model is ``tp/layout.py``. This module holds the shard types and the range arithmetic the rules share.

The same types answer "what does tp rank r hold?" for applying TP, for ``plait plan`` (on a meta model),
for gathering full tensors in tests and checkpoints, and for validation. Every divisibility problem is
found before any process group or weight read.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from plait.base.config import ConfigError
from plait.base.words import setting


Box = tuple[tuple[int, int], ...]  # a block of a tensor: [start, stop) per dim


class TPSizeError(ConfigError):
    """A tp size that a dimension of the model does not split into (heads, kv heads, features). Its own type so
    that ``plan_layout``, which knows the world, can add the tp sizes that would work there."""


@dataclass(frozen=True)
class ExpertAxis:
    """Where a tensor stacked over experts keeps each expert, along ``dim``: ``runs`` consecutive runs over all
    the experts in order, ``block`` entries per expert in each run. transformers' expert weights ([E, ...]) are
    the default: dim 0, one run, one entry per expert. peft's LoRA factors on them (``ParamWrapper``) are A
    [r * E, in], expert-major (dim 0, one run of r rows per expert), and B [out, r * E], rank-major (dim 1,
    r runs of one column per expert)."""

    dim: int = 0
    runs: int = 1
    block: int = 1

    def ranges(self, size: int, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """The index ranges along ``dim`` (of length ``size``) holding experts [start, stop)."""
        run = size // self.runs
        return tuple((i * run + start * self.block, i * run + stop * self.block) for i in range(self.runs))


@dataclass(frozen=True)
class ShardSpec:
    """How a local tensor maps onto the full logical tensor.

    The local tensor is the concatenation along ``dim`` of ``full.narrow(dim, start, stop - start)`` for
    each (start, stop) in ``ranges``, followed by ``pad`` zero slices (vocab padding). ``dim`` None means
    replicated (local == full). ``experts``: a range of whole experts that this rank holds under expert
    parallelism, found along ``expert_axis`` (dim 0, one entry per expert, when None); ``dim`` / ``ranges``
    then split each expert on another dim, as tp does on the intermediate dimension. ``rows``: under ZeRO-3
    (FSDP2), the rank holds only rows [start, stop) of dim 0 of the tensor described so far (its tp/ep shard,
    padding included): ``with_rows``.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0
    experts: tuple[int, int] | None = None
    expert_axis: ExpertAxis | None = None
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.experts is not None and self.dim == self.axis.dim:
            raise ValueError(f"a shard split on dim {self.dim} cannot also hold a range of experts there: {self}")

    @property
    def axis(self) -> ExpertAxis:
        return self.expert_axis or ExpertAxis()

    def with_experts(self, start: int, stop: int) -> "ShardSpec":
        """This spec restricted to experts [start, stop)."""
        return dataclasses.replace(self, experts=(start, stop))

    def with_rows(self, start: int, stop: int) -> "ShardSpec":
        """This spec restricted to rows [start, stop) of dim 0 of its local tensor (a data-parallel shard)."""
        return dataclasses.replace(self, rows=(start, stop))

    @property
    def unsharded(self) -> "ShardSpec":
        """This spec without its data-parallel rows: the tp/ep shard FSDP2 gathers."""
        return dataclasses.replace(self, rows=None)

    def padding(self, local: torch.Tensor) -> torch.Tensor | None:
        """The view of ``local`` (laid out like this spec) that is vocab padding, or None."""
        if not self.pad:
            return None
        size = self.unsharded.local_shape[self.dim]
        lo, hi = size - self.pad, size
        if self.rows is not None:  # dim 0 is cut into rows (a pad on dim 0 is cut with it)
            if self.dim != 0:
                return local.narrow(self.dim, lo, self.pad)
            lo, hi = max(lo, self.rows[0]) - self.rows[0], min(hi, self.rows[1]) - self.rows[0]
            return local.narrow(0, lo, hi - lo) if hi > lo else None
        return local.narrow(self.dim, lo, self.pad)

    def _dim_ranges(self) -> list[tuple[tuple[int, int], ...]]:
        """The ranges of the full tensor this shard holds along each dim (padding aside)."""
        held = [((0, size),) for size in self.full_shape]
        if self.experts is not None:
            held[self.axis.dim] = self.axis.ranges(self.full_shape[self.axis.dim], *self.experts)
        if self.dim is not None:
            held[self.dim] = tuple(self.ranges)
        return held

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = [sum(b - a for a, b in ranges) for ranges in self._dim_ranges()]
        if self.dim is not None:
            shape[self.dim] += self.pad
        if self.rows is not None:
            shape[0] = self.rows[1] - self.rows[0]
        return tuple(shape)

    def boxes(self) -> list[tuple[Box, tuple[int, ...]]]:
        """(box of the full tensor, start of that box in the local tensor) for each block this shard holds, in
        the local tensor's order; padding is in no box."""
        per_dim = []
        for ranges in self._dim_ranges():
            starts = itertools.accumulate((b - a for a, b in ranges), initial=0)
            per_dim.append(list(zip(ranges, starts)))
        boxes = [(tuple(r for r, _ in cell), tuple(s for _, s in cell)) for cell in itertools.product(*per_dim)]
        return boxes if self.rows is None else _cut_rows(boxes, *self.rows)

    def slice_full(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of a full tensor (a copy; padding zero)."""
        local = full.new_zeros(self.local_shape)
        for box, at in self.boxes():
            _view(local, box, at).copy_(_view(full, box))
        return local

    def local_spans(self, indices: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """Where ``ranges[i]`` (for each i in ``indices``) lies along ``dim`` of the local tensor: [start, stop)."""
        starts = list(itertools.accumulate((b - a for a, b in self.ranges), initial=0))
        return tuple((starts[i], starts[i + 1]) for i in indices)

    def place(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write this shard's data (not its padding) into ``full``."""
        for box, at in self.boxes():
            _view(full, box).copy_(_view(local, box, at))


def _cut_rows(
    boxes: list[tuple[Box, tuple[int, ...]]], start: int, stop: int
) -> list[tuple[Box, tuple[int, ...]]]:
    """The parts of ``boxes`` (of a local tensor) that lie in its rows [start, stop), placed in those rows."""
    cut = []
    for box, at in boxes:
        (a, b), row = box[0], at[0]
        lo, hi = max(row, start), min(row + b - a, stop)
        if hi > lo:
            cut.append((((a + lo - row, a + hi - row), *box[1:]), (lo - start, *at[1:])))
    return cut


def _view(tensor: torch.Tensor, box: Box, at: tuple[int, ...] | None = None) -> torch.Tensor:
    """The block of ``tensor`` the size of ``box``, starting at ``at`` (default: at the box's own start)."""
    for d, (a, b) in enumerate(box):
        tensor = tensor.narrow(d, a if at is None else at[d], b - a)
    return tensor


@dataclass
class ModuleShard:
    """The decision for one module: its style, the spec of its weight and bias, and who shares it."""

    name: str
    style: Any  # the TPRule that decided it and builds the module's replacement (tp/styles/, above this module)
    transposed: bool  # transformers Conv1D: weight is [in, out]
    weight: ShardSpec
    bias: ShardSpec | None
    grad_sum_block: int = 1  # >1: replicated kv head shared by this many adjacent tp ranks
    # indices into weight.ranges (and bias.ranges) that all ranks of the grad_sum_block hold (a fused qkv's k and
    # v rows of a replicated kv head, beside the q rows each rank holds alone): only those are summed; () = all
    shared_ranges: tuple[int, ...] = ()
    vocab_range: tuple[int, int] | None = None  # vocab styles: [start, stop) of real rows this rank owns
    local_attrs: dict[str, object] = field(default_factory=dict)  # head counts; a per-rank config copy
    # q/k/v of an attention block: the block's own input enters the TP region (attention code reshapes by
    # its input's sequence length, which must already be the full sequence under SP).
    entered_by_parent: bool = False
    # the attention block that holds this projection, where it is not the projection's parent (a wrapper module
    # around the Linear: Moshi's q_proj.linear): the block's input enters the region and gets the local attrs
    block: str | None = None
    # specs of parameters other than weight and bias (e.g. an experts module's gate_up_proj and down_proj)
    params: dict[str, ShardSpec] = field(default_factory=dict)
    # forward arguments of the owner laid out by q heads on dim 0 ([groups * heads, ...], heads innermost: Bloom's
    # ALiBi bias [batch * heads, 1, S], MPT's [heads, 1, S]) -> (heads, first, stop): the owner gets heads [first, stop)
    head_inputs: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def owner(self) -> str:
        """The module whose forward input enters the TP region for this projection and that holds its local attrs:
        ``block``, else the projection's parent."""
        return self.block or self.name.rpartition(".")[0]

    def spec(self, leaf: str) -> ShardSpec | None:
        """The spec of this module's parameter ``leaf`` (None: replicated)."""
        return getattr(self, leaf) if leaf in ("weight", "bias") else self.params.get(leaf)


@dataclass(frozen=True)
class Part:
    """Spans [start, stop) along ``dim`` of a parameter's local tensor: the part of it that a gradient sum or the
    norm covers where the rest is not (a fused qkv's k and v rows of one kv head replicated over a block of tp
    ranks, beside the q rows each rank holds alone: ``ModuleShard.shared_ranges``)."""

    dim: int
    spans: tuple[tuple[int, int], ...]

    def views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.narrow(self.dim, a, b - a) for a, b in self.spans]

    def numel(self, shape: tuple[int, ...]) -> int:
        return sum(b - a for a, b in self.spans) * math.prod(shape) // shape[self.dim]

    def in_rows(self, start: int, stop: int) -> "Part":
        """This part of a tensor of which this rank holds rows [start, stop) of dim 0 (ZeRO-2/3), in those rows."""
        if self.dim != 0:
            return self
        cut = ((max(a, start) - start, min(b, stop) - start) for a, b in self.spans)
        return Part(0, tuple((a, b) for a, b in cut if b > a))


def even_range(total: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if total % tp:
        raise TPSizeError(f"{what} = {total} is not divisible by {setting('tp', tp)}; choose a {setting('tp')} that "
                          f"divides {total}")
    size = total // tp
    return rank * size, (rank + 1) * size


def linear_shape(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of a Linear or transformers Conv1D."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1], True
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    raise ConfigError(f"module of type {type(module).__name__} cannot be split as a linear (expected Linear or Conv1D)")


def linear_shard(name: str, module: nn.Module, style: Any, out_ranges, in_ranges, pad: int = 0) -> ModuleShard:
    fan_in, fan_out, transposed = linear_shape(module)
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    full = tuple(module.weight.shape)
    if out_ranges is not None:
        weight = ShardSpec(full, out_dim, tuple(out_ranges), pad)
        bias = ShardSpec((fan_out,), 0, tuple(out_ranges), pad) if module.bias is not None else None
    else:
        weight = ShardSpec(full, in_dim, tuple(in_ranges))
        bias = ShardSpec((fan_out,)) if module.bias is not None else None
    return ModuleShard(name, style, transposed, weight, bias)


def vocab_split(vocab: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, pad) of real vocab rows for ``rank`` once vocab is padded to a multiple of tp."""
    per_rank = math.ceil(vocab / tp)
    start = min(rank * per_rank, vocab)
    stop = min(start + per_rank, vocab)
    return start, stop, per_rank - (stop - start)
