"""An adapter from outside plait (examples/plait-opt, for OPT: transformers declares no tp plan for it):
installed like any third-party package, found through its entry point, trained by ``plait train`` under tp=2 +
SP and under pp=2 to the single-process losses, and passed by the conformance kit in every mode that applies.

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

import processes
from plait.run.metrics import read_metrics
from plait.testing import assert_conformance, launch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plait-opt"
TRAIN_FLAGS = ["--max_steps", "3", "--block_size", "16", "--per_device_train_batch_size", "2"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("opt")
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
        sys.modules.pop("plait_opt", None)


@pytest.fixture(scope="module")
def model_config(installed, tmp_path_factory) -> Path:
    import plait_opt

    path = tmp_path_factory.mktemp("opt-config") / "config.json"
    path.write_text(plait_opt.plait_tiny_config().to_json_string())
    return path


def test_listed_by_plait_adapters(env):
    done = processes.run([sys.executable, "-m", "plait", "adapters", "--json"], env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    modes = {mode["name"]: mode for mode in json.loads(done.stdout)}
    assert modes["opt"]["distribution"] == "plait-opt" and modes["opt"]["version"] == "0.1.0"
    assert modes["opt"]["architectures"] == ["opt", "OPTForCausalLM"]
    assert {"plait_tp_plan", "plait_sp_plan", "plait_pipeline_plan", "plait_leaf_modules", "plait_init_weight",
            "plait_tiny_config"} <= set(modes["opt"]["hooks"])


def test_init_reads_opts_init_std(model_config):
    """OPT configs have no initializer_range: the adapter's init hook draws with init_std, as transformers does."""
    import torch
    from transformers import AutoConfig

    from plait import Registry

    config = AutoConfig.from_pretrained(model_config.parent)
    config.init_std = 0.5
    registry = Registry()
    tensor = torch.empty(256, 256)
    assert registry.init_weight(registry.resolve(config), name="model.decoder.layers.0.fc1.weight", tensor=tensor,
                                config=config, generator=torch.Generator().manual_seed(0))
    assert tensor.std().item() == pytest.approx(0.5, rel=0.02)


@pytest.fixture(scope="module")
def single_process_metrics(env, model_config, tmp_path_factory):
    from plait.cli import main
    from plait.plugin import registry

    single = tmp_path_factory.mktemp("single")
    saved = registry._default
    registry._default = None  # this process's registry, reloaded with opt installed
    try:
        main(["train", "--model_config", str(model_config), *TRAIN_FLAGS, "--output_dir", str(single)])
    finally:
        registry._default = saved
    return read_metrics(single)


@pytest.mark.parametrize("layout", [["--tensor_parallel_size", "2"],
                                    ["--pipeline_parallel_size", "2", "--num_microbatches", "2"]])
def test_plait_train_matches_one_process(env, model_config, tmp_path, single_process_metrics, layout):
    """Installed from its own distribution, OPT trains under TP+SP and under PP with one process's losses."""
    launch(["-m", "plait", "train", "--model_config", str(model_config), *TRAIN_FLAGS, *layout,
            "--output_dir", str(tmp_path)], 2, env=env, timeout=300)
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert [r["loss"] for r in metrics] == pytest.approx([r["loss"] for r in single_process_metrics], rel=1e-5)


def test_conformance(installed):
    """Every mode that applies passes (no GQA and no experts: tp4-kv-replicated and the ep modes are skipped)."""
    results = assert_conformance("opt")
    ran = {r.mode for r in results if r.status == "pass"}
    assert {"tp2-sp", "tp2", "tp2-sp-tied", "tp2-tied", "pp2-1f1b", "pp2-interleaved-v2", "pp2-tied",
            "tp2-sp-recompute", "tp2-recompute", "pp2-recompute", "consolidate-tp2-sp", "consolidate-tp2",
            "consolidate-pp2", "dp2", "zero1-dp2", "cp2", "cp2-ring", "cp2-tp2",
            "zero2-dp2", "zero3-dp2", "tp2-zero3-dp2", "pp2-zero3-dp2", "consolidate-zero3-dp2"} == ran


def test_init_fallback_is_stated_only_without_an_init_hook(installed):
    """OPT has init_std, not initializer_range: without the adapter's hook the trainer says what it falls back on."""
    import types

    import plait_opt

    from plait import Registry, hookimpl
    from plait.checkpoint.materialize import init_fallback_note

    config = plait_opt.plait_tiny_config()
    registry = Registry(autoload=False)
    assert init_fallback_note(registry, registry.register(plait_opt), config) is None
    bare = types.ModuleType("opt_without_init")
    bare.plait_adapter_info = hookimpl(lambda: plait_opt.plait_adapter_info())
    for hook in ("plait_tp_plan", "plait_sp_plan", "plait_pipeline_plan", "plait_leaf_modules"):
        setattr(bare, hook, getattr(plait_opt, hook))
    registry = Registry(autoload=False)
    note = init_fallback_note(registry, registry.register(bare), config)
    assert note == ("OPTConfig has no initializer_range: random init draws matrices from normal(0, 0.02); adapter "
                    "'opt' can implement plait_init_weight for the architecture's own init")
