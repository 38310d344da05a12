"""An adapter from outside plait (examples/plait-qwen2): installed like any third-party package, found
through its entry point, trained by ``plait train`` under tp=2 + SP to the single-process losses, and
passed by the conformance kit.

The package is built and installed (not editable) into a private ``--target`` folder that only this
module's processes see, so the shared environment is never changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plait.metrics import read_metrics
from plait.testing import assert_conformance, launch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plait-qwen2"
TRAIN_FLAGS = ["--max_steps", "3", "--block_size", "16", "--per_device_train_batch_size", "2"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen2")
    source = shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(root / "site"), str(source)], check=True, timeout=300)
    return root / "site"


@pytest.fixture(scope="module")
def env(site) -> dict[str, str]:
    """Child processes see the installed adapter and the plait this test imports."""
    return {"PYTHONPATH": os.pathsep.join([str(site), *filter(None, sys.path)])}


@pytest.fixture(scope="module")
def installed(site):
    """The adapter importable and its entry point visible in this process too."""
    sys.path.insert(0, str(site))
    try:
        yield
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("plait_qwen2", None)


@pytest.fixture(scope="module")
def model_config(installed, tmp_path_factory) -> Path:
    import plait_qwen2

    path = tmp_path_factory.mktemp("qwen2-config") / "config.json"
    path.write_text(plait_qwen2.plait_tiny_config().to_json_string())
    return path


def test_listed_by_plait_adapters(env):
    out = subprocess.run([sys.executable, "-m", "plait", "adapters", "--json"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    modes = {mode["name"]: mode for mode in json.loads(out)}
    assert modes["qwen2"]["distribution"] == "plait-qwen2" and modes["qwen2"]["version"] == "0.1.0"
    assert modes["qwen2"]["architectures"] == ["qwen2", "Qwen2ForCausalLM"]
    assert {"plait_tp_plan", "plait_sp_plan", "plait_tiny_config"} <= set(modes["qwen2"]["hooks"])


def test_biased_kv_head_is_replicated_with_its_bias(model_config):
    """At tp=2 the single kv head and its k/v biases sit whole on both ranks; q's bias is split like q."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from plait import Registry
    from plait.tp.layout import plan_tensor_parallel

    config = AutoConfig.from_pretrained(model_config.parent)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    registry = Registry()
    plan = registry.tp_plan(registry.resolve(config), config)
    for rank in range(2):
        shards = plan_tensor_parallel(model, plan, 2, rank)
        k, q = shards["model.layers.0.self_attn.k_proj"], shards["model.layers.0.self_attn.q_proj"]
        assert k.bias.ranges == k.weight.ranges == ((0, 8),) and k.grad_sum_block == 2
        assert q.bias.ranges == q.weight.ranges == ((16 * rank, 16 * rank + 16),)


@pytest.fixture(scope="module")
def single_process_metrics(env, model_config, tmp_path_factory):
    from plait import registry
    from plait.cli import main

    single = tmp_path_factory.mktemp("single")
    saved = registry._default
    registry._default = None  # this process's registry, reloaded with qwen2 installed
    try:
        main(["train", "--model_config", str(model_config), *TRAIN_FLAGS, "--output_dir", str(single)])
    finally:
        registry._default = saved
    return read_metrics(single)


@pytest.mark.parametrize("layout", [["--tensor_parallel_size", "2"],
                                    ["--pipeline_parallel_size", "2", "--num_microbatches", "2"]])
def test_plait_train_matches_one_process(env, model_config, tmp_path, single_process_metrics, layout):
    """Installed from its own distribution, qwen2 trains under TP+SP and under PP with one process's losses."""
    launch(["-m", "plait", "train", "--model_config", str(model_config), *TRAIN_FLAGS, *layout,
            "--output_dir", str(tmp_path)], 2, env=env, timeout=300)
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert [r["loss"] for r in metrics] == pytest.approx([r["loss"] for r in single_process_metrics], rel=1e-5)


def test_conformance(installed):
    assert_conformance("qwen2")
