"""Tensor-parallel styles of a mixture-of-experts block: its experts module and its router.

transformers' experts modules hold every expert's weights fused in a few 3-D parameters and route tokens inside
their forward, so these rules do not swap in a parallel layer: they slice the parameters in place (``MoEExperts``
over the intermediate dimension, ``WholeExperts`` not at all) and install on the module, where needed, a region
that says how tokens enter and leave it over tp (``layers.ExpertsRegion`` and its kin). ``MoERouter`` keeps the
router whole.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from plait.base.config import ConfigError
from plait.tp.layers import ExpertMajorRegion, ExpertsRegion, RouterLogitsGather, TokenShareRegion
from plait.tp.sharding import ModuleShard, ShardSpec, even_range
from plait.tp.styles.base import BuildContext, TPRule


def _experts_transposed(module: nn.Module, up, down, fused: bool) -> bool:
    """Whether expert weights are stored [E, in, out] (Llama4: gate_up_proj [E, H, 2I], down_proj [E, I, H]) rather
    than transformers' usual [E, out, in]: the module's ``is_transposed`` when it says, else the shapes (the
    up projection's output pairs with the down projection's input)."""
    if hasattr(module, "is_transposed"):
        return bool(module.is_transposed)
    factor = 2 if fused else 1
    usual, transposed = up.shape[1] == factor * down.shape[2], up.shape[2] == factor * down.shape[1]
    if usual == transposed:
        raise ConfigError(f"{type(module).__name__}: expert weight shapes {tuple(up.shape)} and {tuple(down.shape)} do "
                          f"not say which dimension is the intermediate one")
    return transposed


@dataclass(frozen=True)
class MoEExperts(TPRule):
    """A transformers experts module (weights fused over experts: ``gate_up_proj`` [E, 2I, H] or ``up_proj``
    [E, I, H], and ``down_proj`` [E, H, I]; transposed when ``is_transposed``; gate and up side by side, or
    interleaved when ``is_concatenated`` is False) split over tp on the intermediate dimension I: every rank
    holds a slice of every expert, matching halves of gate and up. The router stays replicated; the module
    becomes its own tensor-parallel region (``layers.ExpertsRegion``)."""

    label: ClassVar[str] = "moe_experts"
    region: ClassVar[type] = ExpertsRegion  # how tokens enter and leave the module (its forward's arguments)

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        params = dict(module.named_parameters(recurse=False))
        arguments = list(inspect.signature(module.forward).parameters)[:len(self.region.ARGS)]
        if tuple(arguments) != self.region.ARGS:
            raise ConfigError(f"{name} ({type(module).__name__}): {self.label} needs forward{self.region.ARGS} "
                              f"(tokens and their routing), found forward({', '.join(arguments)})")
        fused = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
        unknown = sorted(set(params) - {fused, "down_proj"})
        if unknown or "down_proj" not in params or getattr(module, "has_post_expert_norm", False):
            raise ConfigError(f"{name} ({type(module).__name__}): moe_experts splits gate_up_proj / up_proj and "
                              f"down_proj only; found {sorted(params)}")
        transposed = _experts_transposed(module, params[fused], params["down_proj"], fused == "gate_up_proj")
        up_dim, down_dim = (2, 1) if transposed else (1, 2)
        inter = params["down_proj"].shape[down_dim]
        start, stop = even_range(inter, tp, rank, f"{name} expert intermediate size")
        if fused == "up_proj":
            up_ranges = [(start, stop)]
        elif getattr(module, "is_concatenated", True):
            up_ranges = [(start, stop), (inter + start, inter + stop)]
        else:  # [gate_0, up_0, gate_1, up_1, ...]
            up_ranges = [(2 * start, 2 * stop)]
        specs = {fused: ShardSpec(tuple(params[fused].shape), up_dim, tuple(up_ranges)),
                 "down_proj": ShardSpec(tuple(params["down_proj"].shape), down_dim, ((start, stop),))}
        return [ModuleShard(name, self, transposed, specs[fused], None, params=specs)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        for leaf, spec in shard.params.items():
            old = module._parameters[leaf]
            module._parameters[leaf] = nn.Parameter(spec.slice_full(old.detach()), requires_grad=old.requires_grad)
        self.region(ctx.mesh.tp_group, ctx.sequence_parallel).install(module)
        return module


@dataclass(frozen=True)
class ExpertMajorExperts(MoEExperts):
    """``MoEExperts`` for an experts module that takes every token once per expert, pre-scaled by its routing
    score, expert-major (Llama4's ``forward(hidden_states)``, [experts * tokens, hidden]): split the same way,
    entered and left through ``layers.ExpertMajorRegion``."""

    label: ClassVar[str] = "moe_experts_expert_major"
    region: ClassVar[type] = ExpertMajorRegion


@dataclass(frozen=True)
class WholeExperts(MoEExperts):
    """A routed experts module kept whole on every tp rank (expert tensor parallelism off): each tp rank computes
    its own tokens' pairs through whole experts (under SP its sequence shard; without SP a 1/tp share of the rows,
    ``layers.TokenShareRegion``), so no activation crosses tp inside the experts and their weight gradients,
    each covering a share of the tokens, are summed over tp. With expert parallelism the ep all-to-all then moves
    each tp rank's own tokens."""

    label: ClassVar[str] = "moe_experts_whole"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        specs = {leaf: ShardSpec(tuple(p.shape)) for leaf, p in module.named_parameters(recurse=False)}
        first = next(iter(specs.values()))
        return [ModuleShard(name, self, False, first, None, grad_sum_block=tp, params=specs)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        if not ctx.sequence_parallel:
            TokenShareRegion(ctx.mesh.tp_group).install(module)
        return module


@dataclass(frozen=True)
class MoERouter(TPRule):
    """An MoE router kept whole on every rank, for a model whose config asks for router logits (the
    load-balancing loss, ``output_router_logits``): under SP each rank routes its sequence shard's tokens, and
    the logits it returns for the loss are all-gathered (``layers.RouterLogitsGather``) so that every rank
    computes transformers' loss over the whole sequence. Routing itself stays local."""

    label: ClassVar[str] = "moe_router"

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        bias = getattr(module, "bias", None)
        return [ModuleShard(name, self, False, ShardSpec(tuple(module.weight.shape)),
                            ShardSpec(tuple(bias.shape)) if isinstance(bias, nn.Parameter) else None)]

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        if ctx.sequence_parallel:
            RouterLogitsGather(ctx.mesh.tp_group).install(module)
        return module
