"""The multi-node and Slurm examples, run as two torchrun "nodes" on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.metrics import read_metrics
from plait.testing.launcher import free_port
from plait.train_args import TrainArgs
from plait.trainer import train
from tiny_models import tiny_config

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return path


def train_flags(model_config: Path, out: Path) -> list[str]:
    return ["--model_config", str(model_config), "--tensor_parallel_size", "2", "--max_steps", "2",
            "--block_size", "16", "--per_device_train_batch_size", "2", "--output_dir", str(out)]


@pytest.fixture(scope="module")
def reference_losses(model_config, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("ref")
    args = TrainArgs(model_config=str(model_config), max_steps=2, block_size=16, per_device_train_batch_size=2,
                     output_dir=str(out))
    return [r["loss"] for r in train(args)]


def run_all(commands: list[tuple[list[str], dict]], logdir: Path) -> None:
    """Start every command at once, each in its own process group; the first failure, or a hang, ends
    them all (children included) and fails with every command's output."""
    logs = [logdir / f"node{i}.log" for i in range(len(commands))]
    procs = []
    for (cmd, env), log in zip(commands, logs):
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline, failure = time.monotonic() + TIMEOUT, None
    try:
        while any(p.poll() is None for p in procs) and failure is None:
            if any(p.poll() not in (None, 0) for p in procs):
                failure = "a node failed"
            elif time.monotonic() > deadline:
                failure = f"timed out after {TIMEOUT}s"
            time.sleep(0.2)
        if failure is None and any(p.returncode != 0 for p in procs):
            failure = "a node failed"
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    outputs = "\n".join(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
    assert failure is None, f"{failure}\n{outputs}"


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def test_two_nodes_on_localhost(model_config, tmp_path, reference_losses):
    port = str(free_port())
    flags = train_flags(model_config, tmp_path)
    run_all([(["bash", "examples/multinode.sh", *flags],
              {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "NPROC_PER_NODE": "1"}) for rank in range(2)], tmp_path)
    assert losses(tmp_path) == pytest.approx(reference_losses, rel=1e-5)


def test_slurm_script_with_fake_srun(model_config, tmp_path, reference_losses):
    """slurm.sbatch as Slurm would run it: a stand-in srun starts one task per node with SLURM_NODEID."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\nfor ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & done\n'
        'status=0; for job in $(jobs -p); do wait "$job" || status=1; done; exit $status\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "test",
           "SLURM_GPUS_ON_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run_all([(["bash", "examples/slurm.sbatch", *train_flags(model_config, tmp_path)], env)], tmp_path)
    assert losses(tmp_path) == pytest.approx(reference_losses, rel=1e-5)


def test_sft_chat_example_ends_in_a_model_generate_uses(tmp_path):
    """examples/sft_chat.py, 2 steps on one process: tokenizer, chat SFT, consolidate, generate."""
    out = subprocess.run([sys.executable, "examples/sft_chat.py", "--output_dir", str(tmp_path), "--max_steps", "2",
                          "--nproc", "1"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "user: What colour is grass?\nassistant:" in out.stdout
    assert "chat_template" in (tmp_path / "hf" / "tokenizer_config.json").read_text() or \
        (tmp_path / "hf" / "chat_template.jinja").exists()
