"""When no layout of the world fits: the fewest devices each strategy needs, and the cheapest changes that fit.

``plait plan --search`` that ranks nothing is not an answer a user can act on. Two kinds of advice, each found by
the same search over the same global batch:

- more devices: the world doubled (up to 16 times), and for each strategy (the model axes a fitting layout uses:
  tp, pp, cp, ep, and whether ZeRO-1 or recomputation is on) the smallest world where a layout of it fits;
- the same devices, one change each: bf16 parameters with fp32 master weights, then bf16 optimizer state, and
  LoRA adapters on the frozen model (rank 16) in place of a full fine-tune, each with its best layout and peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plait.costs.estimate import LayoutEstimate
from plait.costs.memory import Precision
from plait.costs.search import SearchResult

WORLD_FACTORS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Fit:
    """One way to fit: what changes, the best layout that then fits, its peak and step time."""

    change: str
    layout: LayoutEstimate
    seconds: float


def strategy(estimate: LayoutEstimate) -> str:
    """The axes a layout splits the model over, and its memory savers: what a user would call its strategy."""
    config = estimate.plan.config
    axes = [f"{name}" for name, size in (("tp", config.tp), ("pp", config.pp), ("cp", config.cp), ("ep", config.ep))
            if size > 1]
    zero = f"zero{config.zero_stage}" if config.zero_stage else ""
    savers = [name for name, on in ((zero, bool(zero)), ("recompute", config.gradient_checkpointing)) if on]
    return "+".join(axes or ["dp"]) + (f" ({', '.join(savers)})" if savers else "")


def fewest_devices(search: Callable[[int], SearchResult], world: int) -> list[Fit]:
    """For each strategy, the smallest doubled world (``WORLD_FACTORS``) where one of its layouts fits, with that
    layout; ``search(world)`` is ``search_layouts`` at that world."""
    found: dict[str, Fit] = {}
    for factor in WORLD_FACTORS:
        for estimate, seconds in search(world * factor).ranked:
            found.setdefault(strategy(estimate), Fit(f"{world * factor} devices", estimate, seconds))
        if found:
            break  # the smallest world that fits anything: more devices fit more, but cost more
    return sorted(found.values(), key=lambda fit: fit.seconds)


def cheaper_settings(search: Callable[[Precision, object], SearchResult], precision: Precision,
                     lora: object | None, lora_default: Callable[[], object]) -> list[Fit]:
    """The best layout at the same world with one change each (none already made): bf16 parameters with fp32
    masters, bf16 optimizer state, LoRA; ``search(precision, lora)`` is ``search_layouts`` with them."""
    changes = []
    if precision.param == torch.float32:
        changes.append(("--bf16 (bf16 parameters, fp32 master weights)", Precision(torch.bfloat16, torch.float32),
                        lora))
    if precision.optimizer != torch.bfloat16:
        changes.append(("--bf16 --optimizer_dtype bfloat16 (bf16 optimizer state, no masters)",
                        Precision(torch.bfloat16, torch.bfloat16), lora))
    if lora is None:
        changes.append(("--lora_r 16 (LoRA adapters on the frozen model)", precision, lora_default()))
    fits = []
    for change, changed, adapters in changes:
        ranked = search(changed, adapters).ranked
        if ranked:
            fits.append(Fit(change, *ranked[0]))
    return fits


def describe_fit(fit: Fit, describe: Callable) -> dict:
    return {"change": fit.change, "layout": describe(fit.layout.plan.config), "peak": fit.layout.peak,
            "step_seconds": fit.seconds, "strategy": strategy(fit.layout)}

