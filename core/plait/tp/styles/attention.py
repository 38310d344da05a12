"""Tensor-parallel styles of the sequence-mixing block of a decoder layer: attention split by heads.

``Attention`` splits q, k and v by whole heads (column-parallel) and ``o`` over the same heads (row-parallel);
its variants cover layouts and forwards that plain head runs do not (head counts read from the config, paired
heads, a head-interleaved fused qkv, full-width q/k norms), and ``LatentAttention`` splits DeepSeek's MLA the
same way. They are block rules: one rule decides the shards of all the block's children, linear styles
(``linear``), because the heads a rank keeps must match across q, k, v and o.
``WholeSequence`` is the fallback for a mixer no rule splits (a recurrent or state-space one): kept whole.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from plait.base.config import ConfigError
from plait.base.words import setting
from plait.tp.layers import WholeSequenceRegion
from plait.tp.sharding import ModuleShard, ShardSpec, TPSizeError, linear_shape, linear_shard
from plait.tp.styles.base import BuildContext, TPRule
from plait.tp.styles.linear import Column, FusedQKV, HeadParams, ReplicatedGradSum, Row, SplitNorm


@dataclass(frozen=True)
class Attention(TPRule):
    """An attention block: which children project q, k, v (separately, or fused as ``qkv`` = q|k|v along
    the output features) and the output projection ``o``, plus head counts from the model config.

    Heads split over tp: q heads H/tp per rank; kv heads KV/tp per rank when KV >= tp, or one replicated
    kv head per rank when KV < tp (its gradient summed over the ranks sharing it; in a fused qkv, the k and v rows
    alone, ``ModuleShard.shared_ranges``: multi-query attention, GPT-BigCode's and Falcon's). ``local_attrs`` names
    attributes of the attention module that transformers read from the config and that must hold per-rank
    values, mapped to one of: q_heads, kv_heads, kv_groups, q_width, kv_width.

    ``q_chunks``: the q projection's width per head in head_dims, > 1 when it emits more than the query per
    head, laid out head by head (Qwen3-Next's ``q_proj``: [q_0 gate_0 | q_1 gate_1 | ...], viewed as
    (heads, 2 * head_dim) and chunked): a contiguous run of whole heads is still a column split.
    ``head_columns``: column-parallel children whose outputs are per q head, a multiple of the heads wide (gates:
    Laguna's ``g_proj``), split with the q heads.
    ``head_params``: bare parameters of the block with one entry per q head (attention sinks, [heads]),
    split with the q heads (``HeadParams``).
    ``head_inputs``: forward arguments of the block laid out by q head on dim 0, heads innermost ([batch * heads,
    1, S]: Bloom's ALiBi bias; [heads, 1, S]: MPT's), which each rank gets sliced to its own heads (a forward
    pre-hook, ``apply._slice_head_inputs``): its heads' slopes. They carry no gradient to a parameter.
    """

    o: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    local_attrs: dict[str, str] = field(default_factory=dict)
    q_chunks: int = 1
    head_columns: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()
    head_inputs: tuple[str, ...] = ()
    label: ClassVar[str] = "attention"

    def __post_init__(self) -> None:
        named = [p is not None for p in (self.q, self.k, self.v)]
        if not (all(named) and self.qkv is None or not any(named) and self.qkv is not None):
            raise ValueError(f"Attention({self.pattern!r}) needs either q, k and v, or qkv (fused), not both")
        if self.q_chunks != 1 and self.qkv is not None:
            raise ValueError(f"Attention({self.pattern!r}): q_chunks applies to a separate q projection, not a fused qkv")

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        shards = self._projection_shards(name, module, tp, rank)
        if self.head_params:
            shards.append(HeadParams(name).block_shard(name, module, self.head_params, self.num_heads, tp, rank))
        return shards

    def _projection_shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        self._check_heads(tp)
        q_heads = heads // tp
        q_range = (rank * q_heads * hd, (rank + 1) * q_heads * hd)
        q_out = (q_range[0] * self.q_chunks, q_range[1] * self.q_chunks)
        if kv_heads >= tp:
            local_kv, block = kv_heads // tp, 1
            kv_range = (rank * local_kv * hd, (rank + 1) * local_kv * hd)
        else:
            local_kv, block = 1, tp // kv_heads
            head = rank // block
            kv_range = (head * hd, (head + 1) * hd)
        child = lambda attr: (f"{name}.{attr}", module.get_submodule(attr))  # noqa: E731
        if self.qkv is not None:
            kv_width = kv_heads * hd
            ranges = [q_range, (heads * hd + kv_range[0], heads * hd + kv_range[1]),
                      (heads * hd + kv_width + kv_range[0], heads * hd + kv_width + kv_range[1])]
            fused = linear_shard(*child(self.qkv), FusedQKV(f"{name}.{self.qkv}"), ranges, None)
            if block > 1:  # q rows this rank's own, k and v rows (one kv head) shared with the block: summed there
                fused.grad_sum_block, fused.shared_ranges = block, (1, 2)
            projections = [fused]
        else:
            projections = [linear_shard(*child(self.q), Column(f"{name}.{self.q}"), [q_out], None)]
            for attr in (self.k, self.v):
                shard = linear_shard(*child(attr), Column(f"{name}.{attr}"), [kv_range], None)
                shard.grad_sum_block = block
                projections.append(shard)
        for attr in self.head_columns:  # outputs per q head (gates): the same contiguous run of heads
            width = linear_shape(child(attr)[1])[1]
            if width % heads:
                raise ConfigError(f"{name}.{attr}: {width} output features are not per q head (num_heads={heads})")
            per_head = width // heads
            projections.append(linear_shard(*child(attr), Column(f"{name}.{attr}"),
                                            [(rank * q_heads * per_head, (rank + 1) * q_heads * per_head)], None))
        for shard in projections:
            shard.entered_by_parent, shard.block = True, name
        quantities = {"q_heads": q_heads, "kv_heads": local_kv, "kv_groups": q_heads // local_kv,
                      "q_width": q_heads * hd, "kv_width": local_kv * hd}
        unknown = set(self.local_attrs.values()) - set(quantities)
        if unknown:
            raise ConfigError(f"{name}: local_attrs use unknown quantities {sorted(unknown)}; use {sorted(quantities)}")
        projections[0].local_attrs = {attr: quantities[q] for attr, q in self.local_attrs.items()}
        projections[0].head_inputs = self._head_inputs(q_heads, rank)
        return [*projections, linear_shard(*child(self.o), Row(f"{name}.{self.o}"), None, [q_range])]

    def _head_inputs(self, q_heads: int, rank: int) -> dict[str, tuple[int, int, int]]:
        return {arg: (self.num_heads, rank * q_heads, (rank + 1) * q_heads) for arg in self.head_inputs}

    def _check_heads(self, tp: int) -> None:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if heads % tp:
            raise TPSizeError(f"num_attention_heads={heads} is not divisible by {setting('tp', tp)}; choose a "
                              f"{setting('tp')} that divides {heads}")
        if kv_heads >= tp and kv_heads % tp:
            raise TPSizeError(
                f"num_key_value_heads={kv_heads} is not divisible by {setting('tp', tp)}; choose a {setting('tp')} "
                f"dividing {kv_heads} "
                f"(or a multiple of it that divides num_attention_heads={heads})"
            )
        if kv_heads < tp and tp % kv_heads:
            raise TPSizeError(
                f"tp={tp} is not a multiple of num_key_value_heads={kv_heads}; kv heads are replicated only when "
                f"tp is a multiple of them"
            )


def _head_split(heads: int, kv_heads: int, head_dim: int, tp: int, rank: int) -> tuple:
    """(q range, kv range, local kv heads, ranks sharing a kv head) of rank ``rank``, as ``Attention`` splits."""
    q_heads = heads // tp
    q_range = (rank * q_heads * head_dim, (rank + 1) * q_heads * head_dim)
    if kv_heads >= tp:
        local_kv, block = kv_heads // tp, 1
        return q_range, (rank * local_kv * head_dim, (rank + 1) * local_kv * head_dim), local_kv, block
    block = tp // kv_heads
    head = rank // block
    return q_range, (head * head_dim, (head + 1) * head_dim), 1, block


@dataclass(frozen=True)
class LocalConfigAttention(Attention):
    """``Attention`` for a module whose forward reads head counts from its config (Phi3 slices its fused
    ``qkv_proj`` output at ``config.num_attention_heads * head_dim``): the module gets its own shallow copy of
    the config holding this rank's values. ``config_attrs`` maps config attributes to the quantities of
    ``Attention.local_attrs`` (q_heads, kv_heads, ...)."""

    config_attrs: dict[str, str] = field(default_factory=dict)
    label: ClassVar[str] = "attention"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        shards = super().shards(name, module, tp, rank)
        _, _, local_kv, _ = _head_split(self.num_heads, self.num_kv_heads, self.head_dim, tp, rank)
        q_heads = self.num_heads // tp
        quantities = {"q_heads": q_heads, "kv_heads": local_kv, "kv_groups": q_heads // local_kv,
                      "q_width": q_heads * self.head_dim, "kv_width": local_kv * self.head_dim}
        config = copy.copy(module.config)
        for attr, quantity in self.config_attrs.items():
            setattr(config, attr, quantities[quantity])
        shards[0].local_attrs = {**shards[0].local_attrs, "config": config}
        return shards


@dataclass(frozen=True)
class PairedHeadsAttention(Attention):
    """``Attention`` whose forward pairs q head h with head h + H/2 (DiffLlama's differential attention: the values
    chunked in two halves along the kv heads, the output in two along the heads, ``out1 - lambda * out2`` per pair,
    normed over the pair's 2 x head_dim and reshaped pair by pair for ``o``): each rank keeps the same run of q heads
    from each half, and of kv heads (one kv head of each half replicated over tp / (KV/2) ranks when KV/2 < tp), so
    its pairs are whole, and the contiguous run of ``o``'s input features those pairs produce.
    ``shared_params``: bare parameters of the block every head reads alike (DiffLlama's lambda vectors, [head_dim],
    reduced to one scalar): whole on every rank, their gradients summed over tp."""

    shared_params: tuple[str, ...] = ()
    label: ClassVar[str] = "attention"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        if self.qkv is not None or self.q_chunks != 1 or self.head_columns or self.head_params:
            raise ConfigError(f"{name}: paired heads need separate q, k and v projections, without gates or per-head "
                              f"parameters")
        if self.num_heads % 2 or self.num_kv_heads % 2:
            raise ConfigError(f"{name}: paired heads need even head counts, found {self.num_heads} q and "
                              f"{self.num_kv_heads} kv heads")
        heads, kv_heads, hd = self.num_heads // 2, self.num_kv_heads // 2, self.head_dim
        Attention._check_heads(dataclasses.replace(self, num_heads=heads, num_kv_heads=kv_heads), tp)
        q_range, kv_range, local_kv, block = _head_split(heads, kv_heads, hd, tp, rank)
        halves = lambda r, width: [r, (r[0] + width, r[1] + width)]  # noqa: E731
        child = lambda attr: (f"{name}.{attr}", module.get_submodule(attr))  # noqa: E731
        projections = [linear_shard(*child(self.q), Column(f"{name}.{self.q}"), halves(q_range, heads * hd), None)]
        for attr in (self.k, self.v):
            shard = linear_shard(*child(attr), Column(f"{name}.{attr}"), halves(kv_range, kv_heads * hd), None)
            shard.grad_sum_block = block
            projections.append(shard)
        for shard in projections:
            shard.entered_by_parent, shard.block = True, name
        q_heads = 2 * heads // tp
        quantities = {"q_heads": q_heads, "kv_heads": 2 * local_kv, "kv_groups": q_heads // (2 * local_kv),
                      "q_width": q_heads * hd, "kv_width": 2 * local_kv * hd}
        projections[0].local_attrs = {attr: quantities[q] for attr, q in self.local_attrs.items()}
        pairs = (rank * q_heads * hd, (rank + 1) * q_heads * hd)  # q_heads / 2 pairs of 2 x head_dim features each
        o = linear_shard(*child(self.o), Row(f"{name}.{self.o}"), None, [pairs])
        return [*projections, o, *self._shared_shard(name, module, tp)]

    def _shared_shard(self, name: str, module: nn.Module, tp: int) -> list[ModuleShard]:
        """The block's shared parameters, whole on every rank (full-range specs, as ReplicatedGradSum's), their
        gradients summed over tp: each rank's covers its own pairs only."""
        if not self.shared_params:
            return []
        specs = {leaf: ShardSpec(tuple(module._parameters[leaf].shape), 0, ((0, module._parameters[leaf].shape[0]),))
                 for leaf in self.shared_params}
        first = specs[self.shared_params[0]]
        return [ModuleShard(name, ReplicatedGradSum(name), False, first, None, grad_sum_block=tp, params=specs)]


@dataclass(frozen=True)
class HeadInterleavedAttention(Attention):
    """``Attention`` whose fused ``qkv`` projection is laid out head by head (GPT-NeoX ``query_key_value``:
    [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], viewed as (heads, 3 * head_dim)): each rank keeps a contiguous run of
    whole heads, q, k and v together. Multi-head attention only (no grouped kv heads in this layout).

    ``groups``: the number of such chunks where each holds q, k and v of several heads (CodeGen's ``qkv_proj``:
    ``mp_num`` = 4 chunks of [q | v | k] for heads / 4 heads each, viewed as (-1, 3 * embed_dim / mp_num)); 0
    means one per head. A rank keeps a run of whole chunks, so tp must divide ``groups``."""

    groups: int = 0
    label: ClassVar[str] = "attention"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        if self.qkv is None or self.num_kv_heads != self.num_heads:
            raise ConfigError(f"{name}: a head-interleaved qkv needs qkv= and num_kv_heads == num_heads")
        if self.head_params:
            raise ConfigError(f"{name}: head_params {self.head_params} are not split by a head-interleaved qkv")
        if self.groups and (self.groups % tp or self.num_heads % self.groups):
            raise TPSizeError(f"{name}: the fused qkv is laid out in {self.groups} chunks of q, k and v (of "
                              f"{self.num_heads} heads); choose a {setting('tp')} that divides {self.groups}")
        self._check_heads(tp)
        q_heads, hd = self.num_heads // tp, self.head_dim
        fused = (rank * q_heads * 3 * hd, (rank + 1) * q_heads * 3 * hd)
        q_range = (rank * q_heads * hd, (rank + 1) * q_heads * hd)
        child = lambda attr: (f"{name}.{attr}", module.get_submodule(attr))  # noqa: E731
        qkv = linear_shard(*child(self.qkv), FusedQKV(f"{name}.{self.qkv}"), [fused], None)
        qkv.entered_by_parent, qkv.block = True, name
        quantities = {"q_heads": q_heads, "kv_heads": q_heads, "kv_groups": 1, "q_width": q_heads * hd,
                      "kv_width": q_heads * hd}
        qkv.local_attrs = {attr: quantities[q] for attr, q in self.local_attrs.items()}
        qkv.head_inputs = self._head_inputs(q_heads, rank)
        return [qkv, linear_shard(*child(self.o), Row(f"{name}.{self.o}"), None, [q_range])]


@dataclass(frozen=True)
class FullWidthNormAttention(Attention):
    """``Attention`` with RMSNorms over the whole projected q and k (OLMo2's ``q_norm`` / ``k_norm``, over
    heads x head_dim, not per head): the norms keep this rank's slice of their weight and all-reduce the sum of
    squares (``SplitNorm``) instead of gathering q and k. A k slice replicated over a block of ranks (kv heads
    fewer than tp) is counted once, and its weight's gradient summed over the block like k_proj's."""

    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    label: ClassVar[str] = "attention"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        shards = super().shards(name, module, tp, rank)
        q_range, kv_range, _, block = _head_split(self.num_heads, self.num_kv_heads, self.head_dim, tp, rank)
        for attr, rows, width, copies in ((self.q_norm, q_range, self.num_heads * self.head_dim, 1),
                                          (self.k_norm, kv_range, self.num_kv_heads * self.head_dim, block)):
            norm = module.get_submodule(attr)
            if tuple(norm.weight.shape) != (width,) or [n for n, _ in norm.named_parameters()] != ["weight"]:
                raise ConfigError(f"{name}.{attr}: expected an RMSNorm with one weight of {width} features")
            spec = ShardSpec((width,), 0, (rows,))
            style = SplitNorm(f"{name}.{attr}", full_width=width, copies=copies)
            shards.append(ModuleShard(f"{name}.{attr}", style, False, spec, None, grad_sum_block=copies))
        return shards


@dataclass(frozen=True)
class LatentAttention(TPRule):
    """Multi-head latent attention (DeepSeek-V2/V3's MLA) split by heads, as Megatron splits it: the low-rank down
    projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms, named in ``replicated``, stay whole on
    every rank; the up projections to heads (``q``: ``q_b_proj``, or ``q_proj`` without a q LoRA, q_head_dim =
    nope + rope per head; ``kv_b``: ``kv_b_proj``, [k_nope | v] per head, kv_head_dim = nope + v) are
    column-parallel by whole heads, and ``o`` row-parallel over heads x v_head_dim.

    The block's input enters the tensor-parallel region once (gathered from sequence shards under SP), so the
    down projections run on the full sequence on every rank, and the rotary key part they produce (one ``k_pe``
    shared by all heads) is the same everywhere. Each rank's gradient for them covers only its own heads: their
    parameter gradients are summed over tp (``ReplicatedGradSum``), and their input gradient, partial like every
    projection's, is summed once by the region's entry (all-reduce, or reduce-scatter under SP), not again.
    ``replicated`` may also name the modules of a child that computes without gradients on the same full-sequence
    inputs (DeepSeek-V3.2's sparse-attention indexer): every rank then selects the same tokens.
    ``head_columns``: projections with the same number of outputs per head (Bailing-Hybrid's sigmoid output gate
    ``g_proj`` [heads, hidden], HY-V4's ``gate_proj`` [heads x v_head_dim, hidden]), column-parallel with the heads.
    ``head_params``: bare parameters of the block with one entry per head (attention sinks), split with the heads
    (``HeadParams``).
    ``local_attrs``: attributes of the block holding the head count (``num_heads``), set to this rank's.
    """

    q: str
    kv_b: str
    o: str
    num_heads: int
    q_head_dim: int
    kv_head_dim: int
    v_head_dim: int
    replicated: tuple[str, ...] = ()
    local_attrs: tuple[str, ...] = ()
    head_columns: tuple[str, ...] = ()
    head_params: tuple[str, ...] = ()
    label: ClassVar[str] = "attention"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        if self.num_heads % tp:
            raise TPSizeError(f"num_attention_heads={self.num_heads} is not divisible by {setting('tp', tp)}; choose "
                              f"a {setting('tp')} that divides {self.num_heads}")
        heads = self.num_heads // tp
        first, last = rank * heads, (rank + 1) * heads
        child = lambda attr: (f"{name}.{attr}", module.get_submodule(attr))  # noqa: E731
        gates = {c: linear_shape(module.get_submodule(c))[1] for c in self.head_columns}
        uneven = {c: width for c, width in gates.items() if width % self.num_heads}
        if uneven:
            raise ConfigError(f"{name}: head_columns {uneven} have output features that are not per head "
                              f"(num_heads={self.num_heads}); name only projections with outputs per head")
        widths = ((self.q, self.q_head_dim), (self.kv_b, self.kv_head_dim),
                  *((c, width // self.num_heads) for c, width in gates.items()))
        up = [linear_shard(*child(attr), Column(f"{name}.{attr}"), [(first * width, last * width)], None)
              for attr, width in widths]
        for shard in up:
            shard.entered_by_parent, shard.block = True, name
        up[0].local_attrs = {attr: heads for attr in self.local_attrs}
        down = [shard for attr in self.replicated
                for shard in ReplicatedGradSum(f"{name}.{attr}").shards(*child(attr), tp, rank)]
        o = linear_shard(*child(self.o), Row(f"{name}.{self.o}"), None, [(first * self.v_head_dim,
                                                                          last * self.v_head_dim)])
        sinks = [HeadParams(name).block_shard(name, module, self.head_params, self.num_heads, tp, rank)] \
            if self.head_params else []
        return [*up, *down, o, *sinks]


@dataclass(frozen=True)
class WholeSequence(TPRule):
    """A block kept whole on every rank that must see the whole sequence: a recurrent or state-space mixer
    (Qwen3-Next's gated delta net, for which transformers' own plan gathers every projection's output, i.e.
    computes the block whole on every rank). Without SP its input and output are the same on every rank, so it is
    an ordinary replicated block; under SP it runs on the gathered sequence and keeps this rank's shard of its
    output (``layers.WholeSequenceRegion``), its parameters' gradients summed over tp as the SP plan's norms'
    (the SP plan must name its modules). Its work is repeated on every tp rank, as in transformers' plan
    (docs/decisions.md D10)."""

    argument: str = "hidden_states"  # the forward's first parameter, the hidden states, when passed by keyword
    label: ClassVar[str] = "whole_sequence"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        # a block's own weight or bias (JetMoE's MoE block adds a bias to its experts' sum) is whole: replicated specs
        weight, bias = (module._parameters.get(leaf) for leaf in ("weight", "bias"))
        return [ModuleShard(name, self, False, ShardSpec(tuple(weight.shape) if weight is not None else ()),
                            ShardSpec(tuple(bias.shape)) if bias is not None else None)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        if ctx.sequence_parallel:
            WholeSequenceRegion(ctx.entry, ctx.mesh.tp_group, self.argument).install(module)
        return module
