"""Which sharded linears are row- and which column-parallel, read off a plan's shard specs."""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from plait.layout_plan import LayoutPlan
from plait.tp.styles import WholeExperts

VOCAB_LABELS = ("vocab_embedding", "scaled_vocab_embedding", "vocab_head")
EXPERTS_LABELS = ("moe_experts", "moe_experts_expert_major")


def row_modules(model: nn.Module, plan: LayoutPlan) -> set[str]:
    """Row-parallel linears: the weight is split along its input dimension; and experts modules, which enter and
    leave their own tp region as a column-row pair does (``plait.tp.layers.ExpertsRegion``), whichever way
    their weights are stored."""
    rows = set()
    for name, shard in plan.shards_by_rank[0].items():
        module = model.get_submodule(name)
        in_dim = 0 if isinstance(module, Conv1D) else 1
        label = shard.style.label
        if label in EXPERTS_LABELS or (label not in VOCAB_LABELS and shard.weight.dim == in_dim):
            rows.add(name)
    return rows


def column_modules(model: nn.Module, plan: LayoutPlan) -> set[str]:
    """Column-parallel linears (split along the output dimension, the vocab-parallel head included): their input
    is whole on every tp rank."""
    rows = row_modules(model, plan)
    return {name for name, shard in plan.shards_by_rank[0].items()
            if name not in rows and shard.style.label not in VOCAB_LABELS[:2] and shard.weight.dim is not None}


def shard_saving_columns(plan: LayoutPlan, columns: set[str]) -> set[str]:
    """Column-parallel linears of the tp region: under SP they save their input's sequence shard, not the gathered
    input (``plait.tp.layers``). Not the vocab-parallel head (its input is gathered before it), nor under float8,
    whose kernel keeps what it saves."""
    if plan.config.float8:
        return set()
    return {name for name in columns if plan.shards_by_rank[0][name].style.label not in VOCAB_LABELS}


def whole_experts(plan: LayoutPlan) -> set[str]:
    """Experts modules kept whole on every tp rank (``ParallelConfig(expert_tensor_parallel=False)``,
    ``plait.tp.styles.WholeExperts``): each tp rank computes only its own 1/tp of the tokens' pairs."""
    return {name for name, shard in plan.shards_by_rank[0].items() if isinstance(shard.style, WholeExperts)}
