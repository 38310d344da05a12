"""Tensor-parallel styles of single modules: linears split by output features (``Column``, ``FusedColumn``,
``FusedQKV``) or input features (``Row``), the vocab-parallel embedding and head, an RMSNorm over split features
(``SplitNorm``), and parameters kept whole or split by head (``ReplicatedGradSum``, ``HeadParams``).

Each rule here splits one module on its own, so these are the pieces the block rules (``attention``) compose:
an attention block's projections are Columns and a Row, its per-head norms ReplicatedGradSum or SplitNorm.
Linear and transformers' Conv1D (a transposed linear) are both handled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from plait.base.config import ConfigError
from plait.tp.layers import (
    ColumnParallelLinear, RowParallelLinear, ScaledVocabParallelEmbedding, SplitRMSNorm, VocabParallelEmbedding,
)
from plait.tp.sharding import ModuleShard, ShardSpec, even_range, linear_shape, linear_shard, vocab_split
from plait.tp.styles.base import BuildContext, TPRule


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
        if shard.entered_by_parent:  # its input arrives entered; the region's entry still knows its shard
            return ColumnParallelLinear(weight, bias, shard.transposed, None, parent_entry=ctx.entry)
        return ColumnParallelLinear(weight, bias, shard.transposed, ctx.entry)


@dataclass(frozen=True)
class FusedQKV(Column):
    """The fused q/k/v projection of an ``Attention`` block (built as a Column; its ranges, whole heads of q, k
    and v, come from the block's rule). Its own label says in ``plait plan`` that nothing is gathered."""

    label: ClassVar[str] = "fused_qkv"


@dataclass(frozen=True)
class FusedColumn(Column):
    """A column-parallel linear whose output is ``chunks`` projections side by side (Phi3's ``gate_up_proj``:
    gate | up): each rank keeps the same slice of every chunk, so a chunk(2) of its output pairs matching gate
    and up features for a row-parallel projection after it."""

    chunks: int = 2
    label: ClassVar[str] = "fused_column"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        _, fan_out, _ = linear_shape(module)
        if fan_out % self.chunks:
            raise ConfigError(f"{name}: {fan_out} output features do not split into {self.chunks} fused projections")
        width = fan_out // self.chunks
        start, stop = even_range(width, tp, rank, f"{name} output features per fused projection")
        ranges = [(c * width + start, c * width + stop) for c in range(self.chunks)]
        return [linear_shard(name, module, self, ranges, None)]


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
class ScaledVocabEmbedding(VocabEmbedding):
    """``VocabEmbedding`` for an embedding module that multiplies its lookups by a constant (transformers'
    scaled word embeddings, e.g. Gemma3's): the float attribute ``scale_attr`` of the module holds it, and the
    tensor buffer ``buffer_attr`` the value the module multiplies by (``scale``)."""

    scale_attr: str = "scalar_embed_scale"
    buffer_attr: str = "embed_scale"
    label: ClassVar[str] = "scaled_vocab_embedding"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        if not isinstance(getattr(module, self.scale_attr, None), (int, float)):
            raise ConfigError(f"{name} ({type(module).__name__}) has no number {self.scale_attr!r} to scale lookups by")
        return super().shards(name, module, tp, rank)

    def scale(self, module: nn.Module) -> float:
        """What ``module`` multiplies by: its buffer's value, which depends on how the model was made (a buffer
        made float32 holds the float32-rounded root, also after the model is made float64; one made under a float64
        default the exact root); a buffer still on the meta device has only its dtype to say which."""
        scalar, buffer = float(getattr(module, self.scale_attr)), getattr(module, self.buffer_attr, None)
        if not isinstance(buffer, torch.Tensor) or buffer.numel() != 1:
            return scalar
        if not buffer.is_meta:
            return float(buffer.item())
        return struct.unpack("f", struct.pack("f", scalar))[0] if buffer.dtype == torch.float32 else scalar

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, _ = _local(shard, module)
        start, stop = shard.vocab_range
        return ScaledVocabParallelEmbedding(weight, start, stop, module.num_embeddings, module.padding_idx,
                                            ctx.mesh.tp_group, scale=self.scale(module))


@dataclass(frozen=True)
class SplitNorm(TPRule):
    """An RMSNorm over features a column-parallel projection split: weight sliced like the features, sum of
    squares all-reduced (``layers.SplitRMSNorm``). Built by ``FullWidthNormAttention`` for q/k norms; as a rule of
    its own (``full_width`` 0: its weight's width), for a norm whose features are split evenly over tp, as a
    Column's outputs or an attention block's heads are (BitNet's ``attn_sub_norm`` before ``o_proj`` and
    ``ffn_sub_norm`` before ``down_proj``)."""

    full_width: int = 0
    copies: int = 1
    label: ClassVar[str] = "split_rms_norm"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        weight = getattr(module, "weight", None)
        if [n for n, _ in module.named_parameters()] != ["weight"] or weight.dim() != 1:
            raise ConfigError(f"{name} ({type(module).__name__}): a split RMSNorm has one weight of one dimension")
        rows = even_range(weight.shape[0], tp, rank, f"{name} features")
        return [ModuleShard(name, self, False, ShardSpec(tuple(weight.shape), 0, (rows,)), None)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        weight, _ = _local(shard, module)
        eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps")
        width = self.full_width or shard.weight.full_shape[0]
        return SplitRMSNorm(weight, eps, width, self.copies, ctx.mesh.tp_group)


@dataclass(frozen=True)
class ReplicatedGradSum(TPRule):
    """A module kept whole on every rank whose gradient each rank computes only in part, summed over tp:
    per-head q/k norms (Qwen3, Gemma3) inside an attention block see only this rank's heads; the low-rank down
    projections of latent attention feed only this rank's heads (``LatentAttention``); a learned activation's
    scalars, applied elementwise to the features a column-parallel projection split (Apertus' xIELU
    ``alpha_p`` and ``alpha_n``), see only this rank's features.

    Its specs name the full range along dim 0 on every rank (not ``dim=None``), so that the sequence-parallel
    region does not count it a second time as a norm on sequence shards; ranks holding equal specs count
    its gradient once in the norm, as for replicated kv heads. Parameters other than a weight and a bias go
    to ``ModuleShard.params``.
    """

    label: ClassVar[str] = "replicated_grad_sum"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        params = dict(module.named_parameters())
        if not params or any("." in leaf or p.dim() == 0 for leaf, p in params.items()):
            found = {leaf: tuple(p.shape) for leaf, p in params.items()}
            raise ConfigError(f"{name} ({type(module).__name__}): replicated_grad_sum handles a module's own "
                              f"parameters of one dimension or more, found {found or 'none'}")
        specs = {leaf: ShardSpec(tuple(p.shape), 0, ((0, p.shape[0]),)) for leaf, p in params.items()}
        weight = specs.get("weight", next(iter(specs.values())))  # ModuleShard always names one spec as its weight
        others = {leaf: spec for leaf, spec in specs.items() if leaf not in ("weight", "bias")}
        return [ModuleShard(name, self, False, weight, specs.get("bias"), grad_sum_block=tp, params=others)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        return module


@dataclass(frozen=True)
class HeadParams(TPRule):
    """Bare parameters of an attention block with one entry per q head (attention sinks: ``sinks``
    [num_attention_heads], read as one logit per local head by the attention function), built by ``Attention``
    when it names them in ``head_params``: each rank keeps the entries of its own q heads, which never repeat
    across ranks (kv heads may, q heads do not), so each rank owns its slice's gradient."""

    label: ClassVar[str] = "head_params"

    def block_shard(self, name: str, module: nn.Module, leaves: tuple[str, ...], heads: int, tp: int,
                    rank: int) -> ModuleShard:
        """The shard of block ``name``'s parameters ``leaves`` (each [heads]) for tp rank ``rank``."""
        q_heads = heads // tp
        specs = {}
        for leaf in leaves:
            param = module._parameters.get(leaf)
            if param is None or tuple(param.shape) != (heads,):
                found = None if param is None else tuple(param.shape)
                raise ConfigError(f"{name}.{leaf}: a per-head parameter needs shape ({heads},) (one entry per q "
                                  f"head), found {found}")
            specs[leaf] = ShardSpec((heads,), 0, ((rank * q_heads, (rank + 1) * q_heads),))
        return ModuleShard(name, self, False, specs[leaves[0]], None, params=specs)

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        for leaf, spec in shard.params.items():
            old = module._parameters[leaf]
            module._parameters[leaf] = nn.Parameter(spec.slice_full(old.detach()), requires_grad=old.requires_grad)
        return module
