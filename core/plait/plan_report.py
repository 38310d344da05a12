"""``plait plan``: how a model would be split, from its config alone (meta device: no weights built)."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from plait.config import ParallelConfig
from plait.pipeline.layout import pipeline_layout, rank_of_stage, stage_bytes
from plait.registry import default_registry
from plait.tp.sharding import param_specs, plan_tensor_parallel
from plait.trainer import load_config_file


def parameter_bytes_per_rank(model: torch.nn.Module, specs_by_rank: list[dict]) -> list[int]:
    """Local parameter bytes of each tp rank (tied parameters counted once)."""
    sizes = {name: p.element_size() for name, p in model.named_parameters()}  # de-duplicated names only
    return [sum(math.prod(specs[name].local_shape) * size for name, size in sizes.items()) for specs in specs_by_rank]


def print_pipeline(console: Console, model: torch.nn.Module, config: ParallelConfig, tp: int) -> None:
    """The stage (and pipeline rank) of every pipeline unit, and parameter bytes per stage."""
    rows = pipeline_layout(model, config)
    table = Table("module", "stage", "pp rank", "parameter bytes (unsharded)")
    for name, stage, size in rows:
        where = ("every stage", "all") if stage is None else (str(stage), str(rank_of_stage(stage, config.pp)))
        table.add_row(name, *where, f"{size:,}")
    console.print(table)
    per_stage = Table("stage", "pp rank", "parameter bytes", f"per tp rank (~/{tp})")
    for stage, size in sorted(stage_bytes(rows).items()):
        per_stage.add_row(str(stage), str(rank_of_stage(stage, config.pp)), f"{size:,}", f"{size // tp:,}")
    console.print(per_stage)


def print_plan(model_config: str, tp: int, sequence_parallel: bool = True, parallel_embeddings: bool = True,
               pipeline: ParallelConfig | None = None) -> None:
    config = load_config_file(Path(model_config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    registry = default_registry()
    adapter = registry.resolve(config)
    plan = registry.tp_plan(adapter, config) if tp > 1 else None
    shards_by_rank = [plan_tensor_parallel(model, plan, tp, r, parallel_embeddings) if plan else {} for r in range(tp)]
    specs_by_rank = [param_specs(model, shards) for shards in shards_by_rank]

    console = Console(width=max(Console().width, 140))
    sp = sequence_parallel and tp > 1
    console.print(f"[bold]{type(model).__name__}[/] via adapter {adapter.name!r}: tp={tp} sp={sp}")
    # Repeated layers collapse into one row: model.layers.* ... (xN).
    rows: Counter = Counter()
    for name, shard in shards_by_rank[0].items():
        key = (re.sub(r"\.\d+\.", ".*.", name), shard.style.label, shard.weight.full_shape, shard.weight.local_shape)
        rows[key] += 1
    table = Table("module", "style", "full weight", "rank 0 weight", "count")
    for (name, style, full, local), count in rows.items():
        table.add_row(name, style, str(full), str(local), str(count))
    console.print(table)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    per_rank = parameter_bytes_per_rank(model, specs_by_rank)
    summary = Table("tp rank", "parameter bytes", "share of model")
    for rank, size in enumerate(per_rank):
        summary.add_row(str(rank), f"{size:,}", f"{size / total:.3f}")
    console.print(summary)
    console.print(f"unsharded model: {total:,} parameter bytes; everything not listed above is replicated")
    if pipeline is not None and pipeline.pp > 1:
        print_pipeline(console, model, pipeline, tp)
