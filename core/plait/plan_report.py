"""``plait plan``: how a model would be split, rendered from the same ``LayoutPlan`` that ``parallelize``
applies (so it shows exactly the layouts ``plait train`` accepts), on a meta model: no weights built."""

from __future__ import annotations

import math
import re
from collections import Counter

import torch
from rich.console import Console
from rich.table import Table

from plait.layout_plan import LayoutPlan
from plait.pipeline.layout import rank_of_stage, stage_bytes, stage_rows


def parameter_bytes_per_rank(model: torch.nn.Module, specs_by_rank: list[dict]) -> list[int]:
    """Local parameter bytes of each tp rank (tied parameters counted once)."""
    sizes = {name: p.element_size() for name, p in model.named_parameters()}  # de-duplicated names only
    return [sum(math.prod(specs[name].local_shape) * size for name, size in sizes.items()) for specs in specs_by_rank]


def print_pipeline(console: Console, model: torch.nn.Module, plan: LayoutPlan) -> None:
    """The stage (and pipeline rank) of every pipeline unit, and parameter bytes per stage."""
    config, rows = plan.config, stage_rows(model, plan.split)
    table = Table("module", "stage", "pp rank", "parameter bytes (unsharded)")
    for name, stage, size in rows:
        where = ("every stage", "all") if stage is None else (str(stage), str(rank_of_stage(stage, config.pp)))
        table.add_row(name, *where, f"{size:,}")
    console.print(table)
    per_stage = Table("stage", "pp rank", "parameter bytes", f"per tp rank (~/{config.tp})")
    for stage, size in sorted(stage_bytes(rows).items()):
        per_stage.add_row(str(stage), str(rank_of_stage(stage, config.pp)), f"{size:,}", f"{size // config.tp:,}")
    console.print(per_stage)


def print_plan(model: torch.nn.Module, plan: LayoutPlan) -> None:
    """Tables for humans: the style and shapes of every sharded module (repeated layers folded into one
    row), parameter bytes per tp rank, and with pp > 1 the stage of every pipeline unit."""
    console = Console(width=max(Console().width, 140))
    console.print(f"[bold]{type(model).__name__}[/] via adapter {plan.adapter.name!r}: {plan.config.describe()}")
    rows: Counter = Counter()
    for name, shard in plan.shards_by_rank[0].items():
        key = (re.sub(r"\.\d+\.", ".*.", name), shard.style.label, shard.weight.full_shape, shard.weight.local_shape)
        rows[key] += 1
    table = Table("module", "style", "full weight", "rank 0 weight", "count")
    for (name, style, full, local), count in rows.items():
        table.add_row(name, style, str(full), str(local), str(count))
    console.print(table)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    summary = Table("tp rank", "parameter bytes", "share of model")
    for rank, size in enumerate(parameter_bytes_per_rank(model, list(plan.specs_by_rank))):
        summary.add_row(str(rank), f"{size:,}", f"{size / total:.3f}")
    console.print(summary)
    console.print(f"unsharded model: {total:,} parameter bytes; everything not listed above is replicated")
    if plan.split is not None:
        print_pipeline(console, model, plan)
