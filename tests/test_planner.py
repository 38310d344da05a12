"""``plait plan``'s planner: exact bytes and collectives against built ranks, refusals, bubble, JSON, a 70B
config from the config alone, and the CLI.

One launch of 2 ranks (tests/workers/planner_worker.py) builds several layouts and records what each rank holds
and which collectives it issues, beside the planner's prediction; the tests assert on its JSON.
"""

from __future__ import annotations

import json
import time
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import plait
from plait import AdapterInfo, ParallelConfig, Registry, TPPlan, hookimpl
from plait.cli import main
from plait.costs.activations import trace_activations
from plait.costs.bubble import bubble_fraction, in_flight
from plait.costs.device import PRESETS
from plait.costs.estimate import Batch, estimate_layout
from plait.costs.memory import Precision
from plait.costs.search import search_layouts
from plait.layout_plan import plan_layout
from plait.meta import build_meta_model
from plait.registry import default_registry
from plait.testing import launch

WORKER = Path(__file__).parent / "workers" / "planner_worker.py"
# Collectives plait.comm does not see: pipeline send/recv (torch.distributed.pipelining's) and ZeRO-1's
# parameter broadcast (ZeroRedundancyOptimizer's own).
UNRECORDED = {("pp", "send"), ("pp", "recv"), ("dp", "broadcast")}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("planner") / "results.json"
    launch([str(WORKER), str(out)], 2, timeout=300)
    return json.loads(out.read_text())


def test_bytes_equal_what_built_ranks_hold(built):
    for rank, layouts in enumerate(built):
        for name, r in layouts.items():
            assert r["measured"] == r["predicted"], \
                f"{name} rank {rank}: built {r['measured']}, planned {r['predicted']}"


def test_no_activation_is_held_past_the_step(built):
    for rank, results in enumerate(built):
        for name, r in results.items():
            assert not r["entry_held_after_step"], f"{name} rank {rank}: the tp region entry kept its input"


def test_collectives_equal_what_a_step_issues(built):
    for rank, layouts in enumerate(built):
        for name, r in layouts.items():
            seen = Counter(op for op, _ in r["records"]), Counter()
            for op, size in r["records"]:
                seen[1][op] += size
            planned = Counter(), Counter()
            for group, op, count, size in r["predicted_comm"]:
                if (group, op) not in UNRECORDED:
                    planned[0][op] += count
                    planned[1][op] += size
            assert seen == planned, f"{name} rank {rank}: counted {seen}, planned {planned}"


def tiny_llama(layers: int = 4) -> LlamaConfig:
    return LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_bubble_and_in_flight_follow_the_schedules():
    one = ParallelConfig(pp=4, num_microbatches=8)
    assert bubble_fraction(one) == pytest.approx(3 / 11)
    inter = ParallelConfig(pp=2, virtual_pipeline_size=2, num_microbatches=4, pipeline_schedule="interleaved-1f1b")
    assert bubble_fraction(inter) == pytest.approx(1 / 9)  # (p-1)/(v*m+p-1), bench/pp_bubble.py's formula
    assert bubble_fraction(ParallelConfig()) == 0.0
    assert [in_flight(one, r) for r in range(4)] == [4, 3, 2, 1]  # 1f1b: min(m, p - r)
    assert in_flight(inter, 0) == 2.5  # ((v-1)*p + 2*(p-1) + 1) / v: 5 chunks of half the rank's layers


def _nopp_registry() -> Registry:
    """A registry whose only adapter claims llama but forbids pipeline parallelism."""
    module = types.ModuleType("nopp")

    @hookimpl
    def plait_adapter_info():
        return AdapterInfo("nopp", ("llama",), plait.Capabilities(pp=False, vpp=False, sp=False))

    @hookimpl
    def plait_tp_plan(config):
        return TPPlan(())

    @hookimpl
    def plait_leaf_modules(config):
        return ["model.layers.*"]

    module.plait_adapter_info, module.plait_tp_plan, module.plait_leaf_modules = (
        plait_adapter_info, plait_tp_plan, plait_leaf_modules)
    registry = Registry(autoload=False)
    registry.register(module)
    return registry


@pytest.mark.parametrize("registry_kind", ["default", "nopp"])
def test_search_refuses_with_reasons(registry_kind):
    registry = default_registry() if registry_kind == "default" else _nopp_registry()
    model = build_meta_model(tiny_llama(layers=2))
    base = plan_layout(model, ParallelConfig(), 4, registry).config
    trace = trace_activations(model, 16, registry, registry.resolve(model.config))
    small = PRESETS["cpu"].__class__(**{**PRESETS["cpu"].__dict__, "memory_bytes": 200_000})
    result = search_layouts(model, base, 4, Batch(6, 16), Precision(), trace, small, registry)
    reasons = " | ".join(reason for _, reason in result.refused)
    assert "does not fit" in reasons
    assert "does not divide" in reasons  # global batch 24 over dp=4 fine, per-device 6 into 4 micro-batches not
    if registry_kind == "nopp":
        assert "does not support pp" in reasons
        assert all(e.plan.config.pp == 1 for e, _ in result.ranked)
    else:
        assert "cannot fill" in reasons  # 2 layers cannot fill pp*vpp = 4 stages
    assert all(e.peak <= small.memory_bytes for e, _ in result.ranked)
    assert [s for _, s in result.ranked] == sorted(s for _, s in result.ranked)


def test_70b_llama_on_64_devices_from_the_config_alone():
    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192)
    start = time.perf_counter()
    registry = default_registry()
    model = build_meta_model(config, torch.bfloat16)
    plan = plan_layout(model, ParallelConfig(tp=8, pp=4, num_microbatches=8, zero_1=True,
                                             gradient_checkpointing=True), 64, registry)
    trace = trace_activations(model, 4096, registry, plan.adapter)
    estimate = estimate_layout(model, plan, Batch(8, 4096), Precision(torch.bfloat16, torch.float32), trace)
    seconds = time.perf_counter() - start
    assert seconds < 15, f"planning 70B on 64 devices took {seconds:.1f} s"
    total = sum(p.numel() for p in model.parameters())
    one_dp_rank = [r for r in estimate.ranks if r.dp_rank == 0]
    replicated = sum(p.numel() for n, p in model.named_parameters() if "norm" in n) * (8 - 1)  # norms on every tp rank
    assert sum(r.static.parameters for r in one_dp_rank) == 2 * (total + replicated)  # bf16, vocab divides by 8
    assert 10 * 2**30 < estimate.peak < 80 * 2**30, estimate.peak / 2**30


def test_cli_plan_json_and_search(tmp_path, capsys):
    path = tmp_path / "config.json"
    tiny_llama().to_json_file(path)
    common = ["plan", "--model_config", str(path), "--block_size", "16", "--per_device_train_batch_size", "4"]
    main([*common, "--tensor_parallel_size", "2", "--world_size", "4", "--zero_1", "--json", "--device_memory", "1"])
    out = json.loads(capsys.readouterr().out)
    assert {"layout", "world_size", "batch", "ranks", "peak", "device_memory", "fits", "communication", "bubble",
            "flops_per_step", "step_seconds", "notes"} <= set(out)
    assert out["world_size"] == 4 and len(out["ranks"]) == 4 and out["fits"] is True
    rank = out["ranks"][0]
    assert rank["peak"] == sum(rank[k] for k in ("parameters", "gradients", "optimizer", "activations_in_flight",
                                                 "transient"))
    assert {c["group"] for c in out["communication"]} == {"tp", "dp"}
    main([*common, "--world_size", "2", "--search", "--hardware", "h100", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert found["command"].startswith("plait train --model_config") and "--nproc_per_node 2" in found["command"]
    assert found["ranked"][0]["step_seconds"] <= found["ranked"][-1]["step_seconds"]
    main([*common, "--world_size", "2", "--search", "--hardware", "a100", "--top", "2"])
    assert "best: plait train" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*common, "--search"])  # no device model
    assert "--hardware" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "--lora_r", "8"])  # not modelled: refused rather than answered as a full fine-tune
    assert "LoRA" in capsys.readouterr().err


def test_routed_experts_are_refused_in_one_line(tmp_path, capsys):
    """The meta device cannot route tokens: plait plan says so instead of failing inside transformers."""
    from plait_transformers import plait_tiny_config

    path = tmp_path / "config.json"
    plait_tiny_config("mixtral").to_json_file(path)
    with pytest.raises(SystemExit):
        main(["plan", "--model_config", str(path), "--block_size", "16", "--tensor_parallel_size", "2",
              "--world_size", "2"])
    err = capsys.readouterr().err
    assert "does not model the activations of routed experts yet (mixtral: model.layers.0.mlp.experts" in err
    assert "Traceback" not in err
