"""Tensor-parallel styles: one class per way of splitting a module, in one place.

A rule names a module pattern. ``shards`` decides, for one tp rank and on a meta model, what each matching
module keeps (pure; every divisibility problem is found here, before any process group); ``build`` makes
the parallel layer that replaces the module from its local weights. Adding a style is one class here and,
if it needs one, one layer in ``tp/layers.py``. Linear and transformers' Conv1D (a transposed linear) are
both handled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from plait.config import ConfigError
from plait.mesh import Mesh
from plait.tp.layers import (
    ColumnParallelLinear, RowParallelLinear, ScaledVocabParallelEmbedding, TPRegionEntry, VocabParallelEmbedding,
)
from plait.tp.sharding import ModuleShard, ShardSpec, even_range, linear_shape, linear_shard, vocab_split


@dataclass(frozen=True)
class BuildContext:
    """What building a parallel layer needs from the running world."""

    mesh: Mesh
    entry: TPRegionEntry  # where activations enter the TP region (gathered from sequence shards under SP)
    sequence_parallel: bool


@dataclass(frozen=True)
class TPRule:
    """A module pattern (``model.layers.*.mlp.up_proj``) and how the modules it matches are split."""

    pattern: str
    label: ClassVar[str] = ""
    vocab_parallel: ClassVar[bool] = False  # kept replicated under disable_embedding_parallelization

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        """Shard decisions of tp rank ``rank`` for module ``name`` (and, for a block, its children)."""
        raise NotImplementedError

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        """The parallel layer replacing ``module``, holding this rank's slices of its weights."""
        raise NotImplementedError(f"{type(self).__name__} shards child modules; it builds none itself")


def _local(shard: ModuleShard, module: nn.Module) -> tuple:
    weight = shard.weight.slice_full(module.weight.detach())
    bias = shard.bias.slice_full(module.bias.detach()) if shard.bias is not None else None
    return weight, bias


@dataclass(frozen=True)
class Column(TPRule):
    """Output features split; the input replicated (or gathered from sequence shards)."""

    label: ClassVar[str] = "column"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        _, fan_out, _ = linear_shape(module)
        return [linear_shard(name, module, self, [even_range(fan_out, tp, rank, f"{name} output features")], None)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, bias = _local(shard, module)
        return ColumnParallelLinear(weight, bias, shard.transposed, None if shard.entered_by_parent else ctx.entry)


@dataclass(frozen=True)
class Row(TPRule):
    """Input features split; partial outputs summed (or reduce-scattered to sequence shards)."""

    label: ClassVar[str] = "row"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        fan_in, _, _ = linear_shape(module)
        return [linear_shard(name, module, self, None, [even_range(fan_in, tp, rank, f"{name} input features")])]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, bias = _local(shard, module)
        return RowParallelLinear(weight, bias, shard.transposed, ctx.mesh.tp_group, ctx.sequence_parallel)


@dataclass(frozen=True)
class VocabHead(TPRule):
    """The LM head, column-parallel over the vocab padded to a multiple of tp, feeding the parallel loss."""

    label: ClassVar[str] = "vocab_head"
    vocab_parallel: ClassVar[bool] = True

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        _, vocab, _ = linear_shape(module)
        start, stop, pad = vocab_split(vocab, tp, rank)
        shard = linear_shard(name, module, self, [(start, stop)], None, pad)
        shard.vocab_range = (start, stop)
        return [shard]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, bias = _local(shard, module)
        start, stop = shard.vocab_range
        # Under SP the head's input was gathered from sequence shards already (see sequence_parallel.py).
        entry = None if ctx.sequence_parallel else ctx.entry
        return ColumnParallelLinear(weight, bias, shard.transposed, entry, stop - start)


@dataclass(frozen=True)
class VocabEmbedding(TPRule):
    """Embedding rows (the vocab) split, padded to a multiple of tp; lookups summed over tp."""

    label: ClassVar[str] = "vocab_embedding"
    vocab_parallel: ClassVar[bool] = True

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"{name} is a {type(module).__name__}, not an nn.Embedding; it cannot be vocab-parallel")
        start, stop, pad = vocab_split(module.num_embeddings, tp, rank)
        weight = ShardSpec(tuple(module.weight.shape), 0, ((start, stop),), pad)
        return [ModuleShard(name, self, False, weight, None, vocab_range=(start, stop))]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, _ = _local(shard, module)
        start, stop = shard.vocab_range
        return VocabParallelEmbedding(weight, start, stop, module.num_embeddings, module.padding_idx, ctx.mesh.tp_group)


@dataclass(frozen=True)
class Attention(TPRule):
    """An attention block: which children project q, k, v (separately, or fused as ``qkv`` = q|k|v along
    the output features) and the output projection ``o``, plus head counts from the model config.

    Heads split over tp: q heads H/tp per rank; kv heads KV/tp per rank when KV >= tp, or one replicated
    kv head per rank when KV < tp (its gradient summed over the ranks sharing it). ``local_attrs`` names
    attributes of the attention module that transformers read from the config and that must hold per-rank
    values, mapped to one of: q_heads, kv_heads, kv_groups, q_width, kv_width.
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
    label: ClassVar[str] = "attention"

    def __post_init__(self) -> None:
        named = [p is not None for p in (self.q, self.k, self.v)]
        if not (all(named) and self.qkv is None or not any(named) and self.qkv is not None):
            raise ValueError(f"Attention({self.pattern!r}) needs either q, k and v, or qkv (fused), not both")

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        self._check_heads(tp)
        q_heads = heads // tp
        q_range = (rank * q_heads * hd, (rank + 1) * q_heads * hd)
        if kv_heads >= tp:
            local_kv, block = kv_heads // tp, 1
            kv_range = (rank * local_kv * hd, (rank + 1) * local_kv * hd)
        else:
            local_kv, block = 1, tp // kv_heads
            head = rank // block
            kv_range = (head * hd, (head + 1) * hd)
        child = lambda attr: (f"{name}.{attr}", module.get_submodule(attr))  # noqa: E731
        if self.qkv is not None:
            if block > 1:
                raise ConfigError(f"{name}: fused qkv with num_key_value_heads={kv_heads} < tp={tp} is not supported")
            kv_width = kv_heads * hd
            ranges = [q_range, (heads * hd + kv_range[0], heads * hd + kv_range[1]),
                      (heads * hd + kv_width + kv_range[0], heads * hd + kv_width + kv_range[1])]
            projections = [linear_shard(*child(self.qkv), Column(f"{name}.{self.qkv}"), ranges, None)]
        else:
            projections = [linear_shard(*child(self.q), Column(f"{name}.{self.q}"), [q_range], None)]
            for attr in (self.k, self.v):
                shard = linear_shard(*child(attr), Column(f"{name}.{attr}"), [kv_range], None)
                shard.grad_sum_block = block
                projections.append(shard)
        for shard in projections:
            shard.entered_by_parent = True
        quantities = {"q_heads": q_heads, "kv_heads": local_kv, "kv_groups": q_heads // local_kv,
                      "q_width": q_heads * hd, "kv_width": local_kv * hd}
        unknown = set(self.local_attrs.values()) - set(quantities)
        if unknown:
            raise ConfigError(f"{name}: local_attrs use unknown quantities {sorted(unknown)}; use {sorted(quantities)}")
        projections[0].local_attrs = {attr: quantities[q] for attr, q in self.local_attrs.items()}
        return [*projections, linear_shard(*child(self.o), Row(f"{name}.{self.o}"), None, [q_range])]

    def _check_heads(self, tp: int) -> None:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if heads % tp:
            raise ConfigError(f"num_attention_heads={heads} is not divisible by tp={tp}; choose a tp that divides {heads}")
        if kv_heads >= tp and kv_heads % tp:
            raise ConfigError(
                f"num_key_value_heads={kv_heads} is not divisible by tp={tp}; choose tp dividing {kv_heads} "
                f"(or a multiple of it that divides num_attention_heads={heads})"
            )
        if kv_heads < tp and tp % kv_heads:
            raise ConfigError(
                f"tp={tp} is not a multiple of num_key_value_heads={kv_heads}; kv heads are replicated only when "
                f"tp is a multiple of them"
            )


@dataclass(frozen=True)
class ScaledVocabEmbedding(VocabEmbedding):
    """``VocabEmbedding`` for an embedding module that multiplies its lookups by a constant (transformers'
    scaled word embeddings, e.g. Gemma3's): the float attribute ``scale_attr`` of the module holds it."""

    scale_attr: str = "scalar_embed_scale"
    label: ClassVar[str] = "scaled_vocab_embedding"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        if not isinstance(getattr(module, self.scale_attr, None), (int, float)):
            raise ConfigError(f"{name} ({type(module).__name__}) has no number {self.scale_attr!r} to scale lookups by")
        return super().shards(name, module, tp, rank)

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, _ = _local(shard, module)
        start, stop = shard.vocab_range
        return ScaledVocabParallelEmbedding(weight, start, stop, module.num_embeddings, module.padding_idx,
                                            ctx.mesh.tp_group, scale=float(getattr(module, self.scale_attr)))


@dataclass(frozen=True)
class ReplicatedGradSum(TPRule):
    """A module kept whole on every rank whose gradient each rank computes only in part, summed over tp:
    per-head q/k norms (Qwen3, Gemma3) inside an attention block see only this rank's heads.

    Its spec names the full range along dim 0 on every rank (not ``dim=None``), so that the sequence-parallel
    region does not count it a second time as a norm on sequence shards; ranks holding equal specs count
    its gradient once in the norm, as for replicated kv heads.
    """

    label: ClassVar[str] = "replicated_grad_sum"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        specs = {}
        for leaf in ("weight", "bias"):
            param = getattr(module, leaf, None)
            specs[leaf] = ShardSpec(tuple(param.shape), 0, ((0, param.shape[0]),)) if param is not None else None
        others = sorted(n for n, _ in module.named_parameters() if n not in specs)
        if specs["weight"] is None or others:
            raise ConfigError(f"{name} ({type(module).__name__}): replicated_grad_sum handles modules with a weight "
                              f"(and a bias) only, found parameters {others or 'without a weight'}")
        shard = ModuleShard(name, self, False, specs["weight"], specs["bias"], grad_sum_block=tp)
        return [shard]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        return module
