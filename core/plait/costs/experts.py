"""Routed experts (MoE) and expert parallelism (ep) in the planner: which modules are experts, what their
forward saves, and what ep moves.

Experts are transformers' experts modules (decorated with ``use_experts_implementation``: ``forward(hidden_states,
top_k_index, top_k_weights)`` on flattened tokens, ``gate_up_proj`` [E, 2I, H] or ``up_proj`` [E, I, H] and
``down_proj`` [E, H, I] stacked over the E experts, transposed when ``is_transposed``, optional ``*_bias`` [E, out]).
Under ep every rank holds E/ep of each layer's experts (dim 0 of each of those parameters) and the tp slice of
their intermediate dimension, as ``plait.tp.styles.MoEExperts`` splits it; with expert tensor parallelism off
(``plait.tp.styles.WholeExperts``) it holds them whole and computes only its own 1/tp of the tokens (under SP its
sequence shard, without SP a share of the rows): every tensor below is then 1/tp, none split, the FLOPs 1/tp,
and the all-to-alls move the rank's n/tp tokens.

Activations. The meta device cannot route: transformers' grouped matmul checks its dtype on meta, its loops need
real token counts. So the trace runs the experts' own grouped-matmul forward (``grouped_mm_experts_forward``,
whatever the config's ``experts_implementation``: the eager loop saves the same tensors per expert) with its one
data-dependent kernel, ``_grouped_mm``, replaced by a dense matmul of the same shapes that saves what it saves
(its input; the weight is a parameter). Everything else runs as written: the sort and the gathers (their int64
indices), the up projection's input [S, H], its output [S, 2I] (the gate's activation keeps it), the gated
activation [S, I], the down projection's input [S, I] and output [S, H], the routing weights [S], for S = tokens
x top_k pairs; a model's own gate (gpt-oss's clamp), biases and post-expert norm included. Tensors saved between
the up projection's output and the down projection's input are of the intermediate size, split by tp; the others
are whole on every tp rank (``plait.tp.layers.ExpertsRegion`` gathers the tokens under SP).

Routing is assumed balanced: each of the E experts receives tokens x top_k / E pairs, so under ep a rank computes
its E/ep experts' share of the ep group's pairs: tokens x top_k, as without ep (and without ep a rank computes all
its own pairs whatever the routing). ``--moe_imbalance F`` sizes for skew: the busiest rank computes F times its
share, at most ep times (every pair of the group sent to it); its experts' saved tensors and FLOPs are scaled
by F (``effective_imbalance``). The all-to-all buffers and ``moe_capacity_factor``'s cap are not modelled (a cap
c bounds the busiest rank at about c: pass ``--moe_imbalance`` c or less).

Communication under ep (group "ep", per MoE layer on the rank and micro-batch of b sequences, n = b x S/cp
tokens entering the experts, whole on every tp rank, k = top_k, e bytes per activation element): forward, the
dispatch all-to-all of the n k pairs' hidden vectors (n k H e bytes handed in, (ep-1)/ep of them leaving the
rank) to the ranks owning their experts, and the combine all-to-all bringing the outputs back (n k H e); one
all-to-all of the E per-expert pair counts (E x 8 bytes, int64) before them, so that each rank knows what it
receives; backward the 2 data all-to-alls again, reversed; a recomputed layer repeats its forward's 3.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

from torch import nn

from plait.base.config import ConfigError
from plait.ep.layout import expert_major_experts, is_routed_experts, other_experts, own_experts

WHOLE, SPLIT = "whole", "split"  # an expert tensor's share on a tp rank: all of it, or 1/tp (the intermediate)
COUNT_BYTES = 8  # one int64 pair count per expert


@dataclass(frozen=True)
class RoutedCall:
    """One experts forward on one sequence: its module, tokens in, experts chosen per token, bytes of a routing
    weight and of an expert index (what tp's region gathers beside the tokens)."""

    module: str
    tokens: int
    top_k: int
    num_experts: int
    weight_bytes: int
    index_bytes: int
    major: bool = False  # expert-major experts (``major_experts``): every token through every expert (top_k = E)


def routed_experts(model: nn.Module) -> dict[str, int]:
    """Experts module name -> number of experts, in model order."""
    return {name: module.down_proj.shape[0] for name, module in model.named_modules() if is_routed_experts(module)}


def major_experts(model: nn.Module) -> dict[str, int]:
    """Expert-major experts modules (Llama 4's: ``plait.ep.layout.expert_major_experts``), name -> number of
    experts. Their forward runs as written on the meta device (batched matmuls over [E, T, H], no routing): every
    token reaches every expert, scaled by its score before; under ep a rank runs its E/ep experts on every ep rank's
    tokens, E x T rows as without ep, and the all-to-alls move whole blocks (module docstring's formulas with
    top_k = E and one token count per ep rank, not per expert)."""
    return {name: module.num_experts for name, module in expert_major_experts(model).items()}


def divided_experts(model: nn.Module) -> dict[str, int]:
    """Every experts module the planner models, whose experts ep divides (routed and expert-major), name ->
    number of experts."""
    return routed_experts(model) | major_experts(model)


def expert_parameters(model: nn.Module) -> set[str]:
    """Names (every alias) of the parameters ep divides: those of the experts modules."""
    experts = divided_experts(model)
    return {name for name, _ in model.named_parameters(remove_duplicate=False) if name.rpartition(".")[0] in experts}


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Refuse an ep that cannot divide ``model``'s experts (or a model without any), naming the values and the fix."""
    if ep == 1:
        return
    experts = divided_experts(model)
    refuse_unmodelled_experts(model)  # experts plait trains at ep, which the planner does not size
    if not experts:
        raise ConfigError(f"ep={ep} divides routed experts, and {model.config.model_type} has none; drop "
                          f"--expert_parallel_size (ep is for MoE models)")
    for name, count in experts.items():
        if count % ep:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError(f"ep={ep} does not divide the {count} experts of {name}; choose an ep that divides "
                              f"{count} ({', '.join(map(str, fits))}) and dp*cp")


def effective_imbalance(imbalance: float, ep: int) -> float:
    """The factor on the busiest rank's expert work: ``imbalance`` under ep, at most ep; 1 without ep (a rank then
    computes all its own pairs whatever the routing)."""
    return min(imbalance, float(ep)) if ep > 1 else 1.0


class ShapeOnlyExperts:
    """While active (``with``), every experts module of the model runs transformers' grouped-matmul forward with the
    grouped matmul replaced by a dense one of the same shapes (module docstring); ``split`` says whether the
    tensors being saved now are of the intermediate size (after the up projection, before the down one)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [module for module in model.modules() if is_routed_experts(module)]
        self.split = False

    def _matmul(self, input, weight, offs):
        out = input.to(weight.dtype) @ weight[0]  # saves input (and a view of the weight, a parameter)
        self.split = not self.split  # the up projection's output is intermediate, the down projection's is not
        return out

    @contextmanager
    def active(self) -> Iterator[ShapeOnlyExperts]:
        from transformers.integrations import moe  # only where experts are traced

        def forward(module, hidden_states, top_k_index, top_k_weights):
            self.split = False
            return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)

        for module in self.modules:
            module.forward = types.MethodType(forward, module)
        try:
            with mock.patch.object(moe, "_grouped_mm", self._matmul):
                yield self
        finally:
            for module in self.modules:
                del module.forward  # the class's forward again


def token_share(rows: int, tp: int, whole: bool) -> int:
    """Rows of ``rows`` flattened tokens an experts module computes on a tp rank: all of them when its experts are
    split over tp (``ExpertsRegion`` hands every rank all tokens), else the rank's 1/tp (its sequence shard under
    SP; without SP ``TokenShareRegion``'s share, padded to a multiple of tp)."""
    return -(-rows // tp) if whole else rows


def ep_comm(calls: Sequence[tuple[RoutedCall, bool]], sequences: int, cp: int, hidden: int, act_bytes: int,
            microbatches: int, tp: int = 1, whole: frozenset[str] | set[str] = frozenset(), ep: int = 1,
            ) -> tuple[int, int]:
    """(count, bytes) of one micro-step's ep all-to-alls on a rank running ``calls`` (each with whether its layer
    is recomputed) for ``sequences`` sequences split into ``microbatches`` (module docstring); ``whole``: experts
    modules kept whole over ``tp`` ranks, whose all-to-alls move the rank's 1/tp of the tokens; expert-major
    calls exchange one token count per ``ep`` rank."""
    count = size = 0
    for call, recomputed in calls:
        rows = sequences // microbatches * call.tokens // cp  # the rank's tokens in one micro-batch
        tokens = microbatches * token_share(rows, tp, call.module in whole)
        passes = 2 + (1 if recomputed else 0)  # forward, backward, forward again
        count += microbatches * (2 * passes + 1 + (1 if recomputed else 0))
        size += 2 * passes * tokens * call.top_k * hidden * act_bytes
        size += microbatches * (1 + (1 if recomputed else 0)) * (ep if call.major else call.num_experts) * COUNT_BYTES
    return count, size


def expert_flops_per_token(calls: list[RoutedCall], local_numel: dict[str, int], ep: int, imbalance: float,
                           seq: int, tp: int = 1, whole: frozenset[str] | set[str] = frozenset()) -> float:
    """Forward matmul FLOPs per token of a rank for its experts ``calls``: 2 per weight element of one expert per
    pair it computes (top_k per routed token, times the busiest rank's ``imbalance``). ``local_numel``: elements of
    each experts module's stacked weights the rank holds (E/ep experts, 1/tp of each, or all of each for the
    modules in ``whole``, which compute 1/tp of the tokens)."""
    return sum(2 * local_numel[c.module] / (c.num_experts // ep) * c.top_k * c.tokens / seq
               * (1.0 if c.major else imbalance) / (tp if c.module in whole else 1) for c in calls)


def refuse_unmodelled_experts(model: nn.Module) -> None:
    """Parameters stacked over experts outside a transformers experts module (Llama4's expert-major experts, DBRX's
    own module, custom ones): their forward is not the one ``ShapeOnlyExperts`` stands in for (DBRX's routes on the
    meta device's data-dependent ops), with ep or without."""
    stacked = unrouted_stack(model)
    if stacked is not None:
        raise ConfigError(
            f"plait plan models transformers' experts modules (use_experts_implementation), not "
            f"{model.config.model_type}'s {stacked}, stacked over experts in a module of its own; size the run "
            f"with plait train --max_steps 2")


def unrouted_stack(model: nn.Module) -> str | None:
    """A parameter stacked over experts outside a transformers experts module (3-D, or under a model's own
    routed-experts module: DBRX's 2-D [experts x ffn, hidden]): the planner cannot run it."""
    own = next(iter(own_experts(model).values()), None)
    if own is not None:
        return next(f"{name}" for name, p in model.named_parameters() if any(p is q for q in own[0].parameters()))
    name = other_experts(model, skip=divided_experts(model))
    if name is None:
        return None
    return next(f"{name}.{leaf}" for leaf, p in model.get_submodule(name).named_parameters(recurse=False)
                if p.dim() == 3)
