"""Qwen2-MoE with its shared expert split over tp as well (the generic adapter keeps it whole): the sparse MoE
block flattens the hidden states to [tokens, hidden] before calling the shared expert, so under sequence
parallelism its column-parallel input is gathered, and its row-parallel output reduce-scattered, on dim 0."""

from plait import AdapterInfo, Column, Row, SPPlan, TPPlan, hookimpl

import plait_transformers
from plait_transformers.derivation import derive

SHARED = "model.layers.*.mlp.shared_expert"


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="qwen2_moe-shared-split", architectures=("qwen2_moe",))


@hookimpl
def plait_tp_plan(config):
    rules = derive(config).tp.rules
    return TPPlan((*rules, Column(f"{SHARED}.gate_proj"), Column(f"{SHARED}.up_proj"), Row(f"{SHARED}.down_proj")))


@hookimpl
def plait_sp_plan(config):
    sp = derive(config).sp
    return SPPlan(begin=sp.begin, end=sp.end, norms=tuple(n for n in sp.norms if not n.startswith(SHARED + ".")))


@hookimpl
def plait_pipeline_plan(config):
    return derive(config).pipeline


@hookimpl
def plait_leaf_modules(config):
    return derive(config).leaves


@hookimpl
def plait_tiny_config():
    return plait_transformers.plait_tiny_config("qwen2_moe")
