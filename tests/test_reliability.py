"""No hangs, and the same run twice gives the same losses.

A rank that raises mid-training, or that is stuck before a collective, ends the whole torchrun job with a
non-zero status within a bounded time, with the reason on screen and no process left behind
(faults are injected with ``PLAIT_FAULT_INJECT``, see plait/base/faults.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from plait.run.metrics import read_metrics
from plait.testing import launch
from tiny_models import tiny_config

# The stuck rank's test waits --ddp_timeout out twice (its peer's collective, then its own grace after SIGTERM): the
# least that stays well over the ranks' skew at their first collective, which it also bounds (both import the same
# modules at once: up to 2.5 s apart measured, 2 cores with a third process busy). 10 s cost 8 s more.
DDP_TIMEOUT_S = 6


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return path


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    """A slice of the bundled corpus: tokenizing all of it would dominate these tests' time."""
    from plait.data import default_corpus_path

    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(default_corpus_path().read_text()[:30000])
    return path


@pytest.fixture
def train_flags(model_config, train_file):
    def flags(out: Path, steps: int = 4) -> list[str]:
        return ["--model_config", str(model_config), "--train_file", str(train_file), "--output_dir", str(out),
                "--max_steps", str(steps),
                "--per_device_train_batch_size", "2", "--block_size", "16", "--logging_steps", "100"]
    return flags


def metrics_steps(out: Path) -> int:
    return len(read_metrics(out)) if (out / "metrics.jsonl").exists() else 0


def run_torchrun_with_fault(flags: list[str], out: Path, fault: str, fault_step: int, timeout: float) -> dict:
    """Run ``torchrun --nproc_per_node 2 -m plait train`` with a fault; return exit code, output, timings and
    the worker processes still alive after torchrun returned.

    ``fault_at`` is when rank 0 had logged the step before the fault (metrics.jsonl, polled every 50 ms).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "plait", "train", *flags]
    env = {**os.environ, "PLAIT_FAULT_INJECT": fault, "OMP_NUM_THREADS": "1"}
    log = out.parent / f"{out.name}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        agent = psutil.Process(proc.pid)
        workers: set[psutil.Process] = set()
        start, fault_at = time.monotonic(), None
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout:
                    raise AssertionError(f"torchrun still running after {timeout}s: a hang\n{log.read_text()[-3000:]}")
                try:
                    workers.update(agent.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
                if fault_at is None and metrics_steps(out) >= fault_step - 1:
                    fault_at = time.monotonic()
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    end = time.monotonic()
    alive = [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    return {"code": proc.returncode, "output": log.read_text(), "after_fault_s": end - (fault_at or start),
            "total_s": end - start, "workers": len(workers), "alive": alive}


@pytest.mark.slow
def test_failing_rank_ends_the_job(train_flags, tmp_path):
    """Rank 1 raises at step 2 while rank 0 goes on into the step's collectives: torchrun stops rank 0."""
    out = tmp_path / "out"
    result = run_torchrun_with_fault(train_flags(out) + ["--tensor_parallel_size", "2"], out,
                                     "1:2", fault_step=2, timeout=120)
    print(f"failing rank: exit {result['code']}, {result['after_fault_s']:.1f}s after step 1 was logged, "
          f"{result['total_s']:.1f}s in all")
    assert result["code"] != 0
    assert "injected fault on rank 1 at step 2" in result["output"]
    assert result["workers"] >= 2 and not result["alive"], f"workers still running: {result['alive']}"
    assert result["after_fault_s"] < 15, f"took {result['after_fault_s']:.1f}s after the fault to end the job"
    assert metrics_steps(out) == 1


@pytest.mark.slow
def test_stuck_rank_is_ended_by_ddp_timeout(train_flags, tmp_path):
    """Rank 1 sleeps before step 2; rank 0 waits in a collective until --ddp_timeout, then fails clearly; the
    stuck rank is ended too, no later than a second --ddp_timeout."""
    out = tmp_path / "out"
    flags = train_flags(out) + ["--tensor_parallel_size", "2", "--ddp_timeout", str(DDP_TIMEOUT_S)]
    result = run_torchrun_with_fault(flags, out, "1:2:sleep", fault_step=2, timeout=120)
    print(f"stuck rank: exit {result['code']}, {result['after_fault_s']:.1f}s after step 1 was logged "
          f"(--ddp_timeout={DDP_TIMEOUT_S}), {result['total_s']:.1f}s in all")
    assert result["code"] != 0
    assert f"a collective waited longer than --ddp_timeout={DDP_TIMEOUT_S}s" in result["output"]
    # its peer names it from the heartbeats (plait.run.heartbeat): alive, but behind the others
    assert "is stuck at step 2, phase data (it still runs, but the others reached step 2, phase forward-backward)" \
        in result["output"] and "rank 1 (" in result["output"], result["output"][-3000:]
    assert result["workers"] >= 2 and not result["alive"], f"workers still running: {result['alive']}"
    # torchrun then sends the stuck rank SIGTERM, which plait takes as "stop after this step" (plait.run.stop); its
    # step never ends, so it ends itself when the grace period (--ddp_timeout again) runs out, and says so
    assert f"rank 1 did not stop within --ddp_timeout={DDP_TIMEOUT_S}s of SIGTERM" in result["output"]
    assert DDP_TIMEOUT_S - 1 < result["after_fault_s"] < 2 * DDP_TIMEOUT_S + 10, (
        f"ended {result['after_fault_s']:.1f}s after the fault; expected --ddp_timeout={DDP_TIMEOUT_S}s for rank 0 "
        f"to give up, then at most as long again for the stuck rank's grace period")


def read_losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor_parallel_size", "2"],
                                    ["--pipeline_parallel_size", "2", "--num_microbatches", "2"]],
                         ids=["tp2", "pp2"])
def test_same_seed_same_layout_bit_identical(train_flags, tmp_path, layout):
    """Two separate runs, same seed and layout: every step's loss is bit-for-bit the same."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        launch(["-m", "plait", "train", *train_flags(out, steps=3), *layout], 2, timeout=180)
        runs.append(read_losses(out))
    assert len(runs[0]) == 3
    assert runs[0] == runs[1], f"losses differ between identical runs: {runs[0]} vs {runs[1]}"
