"""From a TP plan and a model to per-parameter shard specs: pure functions, no communication.

The same code answers "what does tp rank r hold?" for applying TP, for ``plait plan`` (on a meta model),
for gathering full tensors in tests and checkpoints, and for validation. Every divisibility problem is
found here, before any process group or weight read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from plait.config import ConfigError
from plait.plan import Attention, Rule, Style, TPPlan, matches


@dataclass(frozen=True)
class ShardSpec:
    """How a local tensor maps onto the full logical tensor.

    The local tensor is the concatenation along ``dim`` of ``full.narrow(dim, start, stop - start)`` for
    each (start, stop) in ``ranges``, followed by ``pad`` zero slices (vocab padding). ``dim`` None means
    replicated (local == full).
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = sum(b - a for a, b in self.ranges) + self.pad
        return tuple(shape)

    def slice_full(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of a full tensor (a copy)."""
        if self.dim is None:
            return full.clone()
        pieces = [full.narrow(self.dim, a, b - a) for a, b in self.ranges]
        if self.pad:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.pad
            pieces.append(full.new_zeros(pad_shape))
        return torch.cat(pieces, dim=self.dim).contiguous()

    def place(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write this shard's data (not its padding) into ``full``."""
        if self.dim is None:
            full.copy_(local)
            return
        offset = 0
        for a, b in self.ranges:
            full.narrow(self.dim, a, b - a).copy_(local.narrow(self.dim, offset, b - a))
            offset += b - a


@dataclass
class ModuleShard:
    """The decision for one module: its style, the spec of its weight and bias, and who shares it."""

    name: str
    style: Style
    transposed: bool  # transformers Conv1D: weight is [in, out]
    weight: ShardSpec
    bias: ShardSpec | None
    grad_sum_block: int = 1  # >1: replicated kv head shared by this many adjacent tp ranks
    vocab_range: tuple[int, int] | None = None  # vocab styles: [start, stop) of real rows this rank owns
    local_attrs: dict[str, int] = field(default_factory=dict)
    # q/k/v of an attention block: the block's own input enters the TP region (attention code reshapes by
    # its input's sequence length, which must already be the full sequence under SP).
    entered_by_parent: bool = False


def _even(total: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if total % tp:
        raise ConfigError(f"{what} = {total} is not divisible by tp={tp}; choose a tp that divides {total}")
    size = total // tp
    return rank * size, (rank + 1) * size


def _linear_shape(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, transposed) of a Linear or transformers Conv1D."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1], True
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    raise ConfigError(f"module of type {type(module).__name__} cannot be split as a linear (expected Linear or Conv1D)")


def _linear_shard(name: str, module: nn.Module, style: Style, out_ranges, in_ranges, pad: int = 0) -> ModuleShard:
    fan_in, fan_out, transposed = _linear_shape(module)
    out_dim, in_dim = (1, 0) if transposed else (0, 1)
    full = tuple(module.weight.shape)
    if out_ranges is not None:
        weight = ShardSpec(full, out_dim, tuple(out_ranges), pad)
        bias = ShardSpec((fan_out,), 0, tuple(out_ranges), pad) if module.bias is not None else None
    else:
        weight = ShardSpec(full, in_dim, tuple(in_ranges))
        bias = ShardSpec((fan_out,)) if module.bias is not None else None
    return ModuleShard(name, style, transposed, weight, bias)


def _vocab_split(vocab: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, pad) of real vocab rows for ``rank`` once vocab is padded to a multiple of tp."""
    per_rank = math.ceil(vocab / tp)
    start = min(rank * per_rank, vocab)
    stop = min(start + per_rank, vocab)
    return start, stop, per_rank - (stop - start)


def _attention_shards(name: str, module: nn.Module, rule: Attention, tp: int, rank: int) -> list[ModuleShard]:
    heads, kv_heads, hd = rule.num_heads, rule.num_kv_heads, rule.head_dim
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
    q_heads = heads // tp
    q_range = (rank * q_heads * hd, (rank + 1) * q_heads * hd)
    if kv_heads >= tp:
        local_kv, block = kv_heads // tp, 1
        kv_range = (rank * local_kv * hd, (rank + 1) * local_kv * hd)
    else:
        local_kv, block = 1, tp // kv_heads
        head = rank // block
        kv_range = (head * hd, (head + 1) * hd)
    child = lambda attr: module.get_submodule(attr)  # noqa: E731
    shards = []
    if rule.qkv is not None:
        if block > 1:
            raise ConfigError(f"{name}: fused qkv with num_key_value_heads={kv_heads} < tp={tp} is not supported")
        kv_width = kv_heads * hd
        ranges = [q_range, (heads * hd + kv_range[0], heads * hd + kv_range[1]),
                  (heads * hd + kv_width + kv_range[0], heads * hd + kv_width + kv_range[1])]
        shards.append(_linear_shard(f"{name}.{rule.qkv}", child(rule.qkv), Style.COLUMN, ranges, None))
    else:
        shards.append(_linear_shard(f"{name}.{rule.q}", child(rule.q), Style.COLUMN, [q_range], None))
        for attr in (rule.k, rule.v):
            shard = _linear_shard(f"{name}.{attr}", child(attr), Style.COLUMN, [kv_range], None)
            shard.grad_sum_block = block
            shards.append(shard)
    for shard in shards:
        shard.entered_by_parent = True
    shards.append(_linear_shard(f"{name}.{rule.o}", child(rule.o), Style.ROW, None, [q_range]))
    quantities = {"q_heads": q_heads, "kv_heads": local_kv, "kv_groups": q_heads // local_kv,
                  "q_width": q_heads * hd, "kv_width": local_kv * hd}
    unknown = set(rule.local_attrs.values()) - set(quantities)
    if unknown:
        raise ConfigError(f"{name}: local_attrs use unknown quantities {sorted(unknown)}; use {sorted(quantities)}")
    shards[0].local_attrs = {attr: quantities[q] for attr, q in rule.local_attrs.items()}
    return shards


def _rule_shard(name: str, module: nn.Module, rule: Rule, tp: int, rank: int) -> ModuleShard:
    if rule.style is Style.COLUMN:
        _, fan_out, _ = _linear_shape(module)
        return _linear_shard(name, module, rule.style, [_even(fan_out, tp, rank, f"{name} output features")], None)
    if rule.style is Style.ROW:
        fan_in, _, _ = _linear_shape(module)
        return _linear_shard(name, module, rule.style, None, [_even(fan_in, tp, rank, f"{name} input features")])
    if rule.style is Style.VOCAB_HEAD:
        _, vocab, _ = _linear_shape(module)
        start, stop, pad = _vocab_split(vocab, tp, rank)
        shard = _linear_shard(name, module, rule.style, [(start, stop)], None, pad)
        shard.vocab_range = (start, stop)
        return shard
    if rule.style is Style.VOCAB_EMBEDDING:
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"{name} is a {type(module).__name__}, not an nn.Embedding; it cannot be vocab-parallel")
        start, stop, pad = _vocab_split(module.num_embeddings, tp, rank)
        weight = ShardSpec(tuple(module.weight.shape), 0, ((start, stop),), pad)
        return ModuleShard(name, rule.style, False, weight, None, vocab_range=(start, stop))
    raise ConfigError(f"{name}: style {rule.style} cannot be applied")


def plan_tensor_parallel(
    model: nn.Module, plan: TPPlan, tp: int, rank: int, parallel_embeddings: bool = True
) -> dict[str, ModuleShard]:
    """Shard decisions of tp rank ``rank`` for every module the plan names (works on meta models).

    Raises ConfigError, naming the values, for sizes that do not divide, and for a plan rule that matches
    no module of the model (a plan written for another model version).
    """
    modules = dict(model.named_modules())
    shards: dict[str, ModuleShard] = {}
    for rule in plan.rules:
        hits = [name for name in modules if matches(rule.pattern, name)]
        if not hits:
            raise ConfigError(
                f"the TP plan names {rule.pattern!r}, but the model ({type(model).__name__}) has no such module; "
                f"the adapter does not fit this model"
            )
        for name in hits:
            if isinstance(rule, Attention):
                found = _attention_shards(name, modules[name], rule, tp, rank)
            elif rule.style is Style.REPLICATED or (
                not parallel_embeddings and rule.style in (Style.VOCAB_EMBEDDING, Style.VOCAB_HEAD)
            ):
                continue
            else:
                found = [_rule_shard(name, modules[name], rule, tp, rank)]
            for shard in found:
                shards[shard.name] = shard
    return shards


def param_specs(model: nn.Module, shards: dict[str, ModuleShard]) -> dict[str, ShardSpec]:
    """Spec of every parameter name of ``model`` (replicated unless a shard decision says otherwise)."""
    specs = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        shard = shards.get(module_name)
        spec = getattr(shard, leaf, None) if shard is not None else None
        specs[name] = spec if spec is not None else ShardSpec(tuple(param.shape))
    return specs
