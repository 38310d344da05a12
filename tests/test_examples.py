"""The multi-node and Slurm examples, run as two torchrun "nodes" on 127.0.0.1, and stopped by SIGTERM as a
scheduler stops them: every worker saves the same step and no process is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from plait.checkpoint import latest_checkpoint

from plait.run.metrics import read_metrics
from plait.run.train_args import TrainArgs
from plait.run.trainer import train
from plait.testing.launcher import free_port
import processes
from tiny_models import tiny_config

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return path


def train_flags(model_config: Path, out: Path, max_steps: int = 2) -> list[str]:
    return ["--model_config", str(model_config), "--tensor_parallel_size", "2", "--max_steps", str(max_steps),
            "--block_size", "16", "--per_device_train_batch_size", "2", "--output_dir", str(out)]


@pytest.fixture(scope="module")
def reference_losses(model_config, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("ref")
    args = TrainArgs(model_config=str(model_config), max_steps=2, block_size=16, per_device_train_batch_size=2,
                     output_dir=str(out))
    return [r["loss"] for r in train(args)]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def run_and_signal(commands: list[tuple[list[str], dict]], logdir: Path, out: Path, torchrun_only: bool) -> str:
    """Start every command at once, each in its own session; once 2 steps are logged, send SIGTERM as a
    scheduler does: to torchrun alone (``torchrun_only``: as Ctrl-C or ``kill`` reaches a torchrun started by
    hand) or to every process of the job (as Slurm signals every task of a step). Every process must then
    end by itself within the timeout; returns every command's output."""
    logs = [logdir / f"node{i}.log" for i in range(len(commands))]
    procs = []
    for (cmd, env), log in zip(commands, logs):
        with open(log, "wb") as sink:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=sink,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    def outputs(tail: int | None = 3000) -> str:
        texts = [log.read_text(errors="replace") for log in logs]
        return "\n".join(f"--- {log.name} ---\n{text[-tail:] if tail else text}" for log, text in zip(logs, texts))

    try:
        deadline = time.monotonic() + TIMEOUT
        while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 2:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, outputs()
            time.sleep(0.2)
        family = [q for p in procs for q in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]]
        torchruns = [q for q in family if "torch.distributed.run" in " ".join(q.cmdline())]
        assert len(torchruns) == 2, family
        for q in torchruns if torchrun_only else family:
            with contextlib.suppress(psutil.NoSuchProcess):
                q.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, f"left running: {alive}\n{outputs()}"
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return outputs(tail=None)


def assert_stopped_and_saved(out: Path, output: str, reference_losses: list[float]) -> None:
    """Both nodes' workers stopped after the same step and saved it together; the losses are one process's."""
    stopped = len(read_metrics(out))
    assert output.count("plait: stopped by SIGTERM") == 1, output[-3000:]  # printed once, by rank 0
    assert f"plait: stopped by SIGTERM after step {stopped} of 100000; saved {out}/checkpoint-{stopped}" in output
    assert latest_checkpoint(out) == out / f"checkpoint-{stopped}"
    assert losses(out)[:2] == pytest.approx(reference_losses, rel=1e-5)


def test_two_nodes_on_localhost(model_config, tmp_path, reference_losses):
    """Two torchrun "nodes" started by hand; SIGTERM to each torchrun, which passes it to its worker."""
    port = str(free_port())
    output = run_and_signal([(["bash", "examples/multinode.sh", *train_flags(model_config, tmp_path, 100000)],
                              {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                               "NPROC_PER_NODE": "1"}) for rank in range(2)], tmp_path, tmp_path, torchrun_only=True)
    assert_stopped_and_saved(tmp_path, output, reference_losses)


def test_slurm_script_with_fake_srun(model_config, tmp_path, reference_losses):
    """slurm.sbatch as Slurm would run it: a stand-in srun starts one task per node with SLURM_NODEID; then
    SIGTERM to every process of the job, as Slurm sends before the time limit (--signal) or on preemption."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\nfor ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & done\n'
        'status=0; for job in $(jobs -p); do wait "$job" || status=1; done; exit $status\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "test",
           "SLURM_GPUS_ON_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = tmp_path / "run"
    output = run_and_signal([(["bash", "examples/slurm.sbatch", *train_flags(model_config, out, 100000)], env)],
                            tmp_path, out, torchrun_only=False)
    assert_stopped_and_saved(out, output, reference_losses)


@pytest.mark.timeout(TIMEOUT)  # a hang fails here; the script's subprocess goes with it
def test_sft_chat_example_ends_in_a_model_generate_uses(tmp_path, capfd, monkeypatch):
    """examples/sft_chat.py, 2 steps on one process: tokenizer, chat SFT, consolidate, generate. The script runs in
    this process (its own imports paid already), and so do its plait commands (plait.cli.main, as the script does)."""
    processes.run_script(ROOT / "examples" / "sft_chat.py", ["--output_dir", tmp_path, "--max_steps", "2",
                                                            "--nproc", "1"], monkeypatch)
    out = capfd.readouterr().out
    assert "user: What colour is grass?\nassistant:" in out, out[-3000:]
    assert "chat_template" in (tmp_path / "hf" / "tokenizer_config.json").read_text() or \
        (tmp_path / "hf" / "chat_template.jinja").exists()


@pytest.mark.timeout(TIMEOUT)
def test_grpo_toy_example_draws_its_reward_curve(tmp_path, capfd, monkeypatch):
    """examples/grpo_toy.py, 2 steps on one process: the prompts, GRPO from the policy's own rollouts, reward.png.
    (The full 40 steps take the reward from 0.31 to 0.96, in one process and at tp=2 alike: docs/post-training.md.)"""
    processes.run_script(ROOT / "examples" / "grpo_toy.py", ["--output_dir", tmp_path, "--max_steps", "2"],
                         monkeypatch)
    out = capfd.readouterr().out
    assert "reward (share of vowels): " in out, out[-3000:]
    assert (tmp_path / "reward.png").stat().st_size > 0
