"""The CUDA + NCCL path on one GPU: skipped cleanly where no GPU is present (CI). Run by hand on a GPU
machine: ``python -m pytest tests/test_gpu.py``.

NCCL refuses two ranks on one device, so each job is a world of one rank with ``PLAIT_SINGLETON_GROUPS=1``:
real one-rank process groups on which every collective call site runs with CUDA tensors. Multi-rank parity
stays on gloo (the rest of the suite).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from plait.run.metrics import read_metrics
from plait.testing.launcher import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ENV = {"PLAIT_SINGLETON_GROUPS": "1"}
WORKER = str(Path(__file__).parent / "workers" / "gpu_worker.py")
TRAIN = ["-m", "plait", "train", "--device", "cuda", "--backend", "nccl", "--per_device_train_batch_size", "4",
         "--block_size", "64", "--learning_rate", "3e-3", "--attn_implementation", "sdpa"]


def plait(*argv: str) -> str:
    """``plait train`` on the GPU with TRAIN's flags, or another subcommand when argv starts with one."""
    command = ["-m", "plait", *argv] if argv[0] == "consolidate" else [*TRAIN, *argv]
    return launch(command, 1, timeout=600, env=ENV)[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """bf16 parameters with fp32 masters, ZeRO-1 over a one-rank dp group, activation checkpointing."""
    out = tmp_path_factory.mktemp("gpu") / "run"
    plait("--output_dir", str(out), "--max_steps", "6", "--save_steps", "3", "--bf16", "--zero_1",
          "--gradient_checkpointing")
    return out


def test_trains_on_cuda(run):
    losses = [r["loss"] for r in read_metrics(run)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(r["peak_device_mb"] > 0 for r in read_metrics(run))  # the allocator's peak, via plait.base.device


def test_resume_from_gpu_checkpoint_matches(run, tmp_path):
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "checkpoint-3", resumed / "checkpoint-3")
    plait("--output_dir", str(resumed), "--max_steps", "6", "--bf16", "--zero_1", "--gradient_checkpointing",
          "--resume_from_checkpoint", "auto")
    # Same kernels on the same inputs; embedding backward's atomics may reorder fp32 sums, so not bitwise.
    for a, b in zip(read_metrics(run)[3:], read_metrics(resumed)):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-3 * abs(a["loss"]), (a, b)


def test_consolidate_then_lazy_load_onto_gpu(run, tmp_path):
    hf = tmp_path / "hf"
    plait("consolidate", str(run / "checkpoint-6"), str(hf), "--dtype", "float32")
    output = launch([WORKER, str(hf)], 1, timeout=600, env=ENV)[0]
    assert "GPU OK" in output, output


def test_torch_compile_matches_eager(tmp_path):
    """fp32, one step: compiled decoder layers give eager's loss (to inductor's reassociation)."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    plait("--output_dir", str(eager), "--max_steps", "2")
    plait("--output_dir", str(compiled), "--max_steps", "2", "--torch_compile")
    for a, b in zip(read_metrics(eager), read_metrics(compiled)):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
