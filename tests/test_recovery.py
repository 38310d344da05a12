"""Surviving failures with checkpoints: a SIGKILLed rank under ``torchrun --max-restarts 1`` resumes from the
newest complete checkpoint and ends with the weights of an uninterrupted run; a save cut short (killed, or
a full disk) never damages the previous checkpoint.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from plait.base.config import ParallelConfig
from plait.checkpoint.format import latest_checkpoint, list_checkpoints
from plait.checkpoint.materialize import load_parallel_model
from plait.cli import main
from plait.run.metrics import read_metrics
from plait.testing import launch
import processes
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return str(path)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> str:
    from plait.data import default_corpus_path

    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(default_corpus_path().read_text()[:30000])
    return str(path)


def flags(model_config: str, train_file: str, out, steps: int, *extra: str) -> list[str]:
    return ["--model_config", model_config, "--train_file", train_file, "--output_dir", str(out),
            "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--block_size", "16",
            "--save_steps", "2", "--logging_steps", "100", *extra]


def consolidated(checkpoint, out) -> dict[str, torch.Tensor]:
    main(["consolidate", str(checkpoint), str(out)])
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_killed_rank_restarts_and_matches_uninterrupted(model_config, train_file, tmp_path):
    """Rank 1 is SIGKILLed while saving step 4's checkpoint, after writing its own files (checkpoint-2 is
    complete); ``plait train --max_restarts 1`` has torchrun restart the job once, and the restarted workers resume
    by themselves (no --resume_from_checkpoint given) from checkpoint-2, never the partial checkpoint-4.tmp, which
    start-up removes; steps 3-6 are recomputed, and the final weights are bit-identical to an uninterrupted tp=2
    run. (``torchrun --max-restarts`` started by hand takes the same path: it is the launcher's own torchrun.)"""
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    launch(["-m", "plait", "train", *flags(model_config, train_file, ref_out, 6, "--tensor_parallel_size", "2")], 2,
           timeout=180)
    cmd = [sys.executable, "-m", "plait", "train", "--nproc_per_node", "2", "--max_restarts", "1",
           *flags(model_config, train_file, out, 6, "--tensor_parallel_size", "2")]
    start = time.monotonic()
    result = processes.run(cmd, timeout=240,
                            env={**os.environ, "PLAIT_FAULT_INJECT": "1:4:kill:save", "OMP_NUM_THREADS": "1"})
    print(f"killed rank, restarted: exit {result.returncode} after {time.monotonic() - start:.1f}s")
    assert result.returncode == 0, result.stderr[-3000:]
    # the restart recovered; the first attempt's surviving rank may name its dead peer before torchrun stops it (a
    # race: once in a whole suite under ATEN_CPU_CAPABILITY=default), and reports nothing else
    errors = [line for line in result.stderr.splitlines() if "plait: error" in line]
    assert all(re.search(r"rank 0: rank 1 \(.*\) stopped responding at step 4, phase save", e) for e in errors), errors

    loads = read_metrics(out, "load")
    assert [r["step"] for r in loads] == [0, 2], loads  # fresh start, then (restarted) from checkpoint-2
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6], steps  # metrics.jsonl goes on: steps 1-4, then 3-6 recomputed
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not list(out.glob("*.tmp"))
    reference = [r["loss"] for r in read_metrics(ref_out)]
    assert [r["loss"] for r in read_metrics(out)] == reference[:4] + reference[2:]

    want = consolidated(ref_out / "checkpoint-6", tmp_path / "ref-model")
    got = consolidated(out / "checkpoint-6", tmp_path / "killed-model")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_max_restarts_alone_runs_its_one_process_under_torchrun(model_config, train_file, tmp_path, monkeypatch):
    """torchrun is what restarts workers, so ``--max_restarts`` without ``--nproc_per_node`` launches the one process
    under it (it was ignored: a failed single-process run never restarted). The restart itself is the test above's."""
    import plait.run.torchrun

    calls = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(plait.run.torchrun, "run_under_torchrun",
                        lambda argv, nproc, grace_s, restarts, forked=None: calls.append((nproc, restarts)) or 0)
    main(["train", *flags(model_config, train_file, tmp_path / "out", 2), "--max_restarts", "2"])
    assert calls == [(1, 2)]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # the launching process trains nothing itself


@pytest.fixture
def two_checkpoints(model_config, train_file, tmp_path):
    """A single-process run with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    main(["train", *flags(model_config, train_file, out, 4)])
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    return out


def test_save_killed_midway_is_ignored_and_removed(model_config, train_file, two_checkpoints):
    """What a kill during the save of step 6 leaves (a checkpoint-6.tmp folder with part of its files) is
    ignored by 'auto', which resumes from checkpoint-4, and removed at start-up."""
    out = two_checkpoints
    partial = out / "checkpoint-6.tmp"
    shutil.copytree(out / "checkpoint-4", partial)
    (partial / "shards" / "index.json").unlink(missing_ok=True)
    for shard in (partial / "shards").glob("*.safetensors"):
        shard.write_bytes(shard.read_bytes()[:100])  # cut short mid-write
    assert latest_checkpoint(out).name == "checkpoint-4"
    main(["train", *flags(model_config, train_file, out, 5, "--resume_from_checkpoint", "auto")])
    assert [r["step"] for r in read_metrics(out, "load")] == [0, 4]
    assert not partial.exists()


def _small_files(limit: int):
    def preexec() -> None:  # a full disk, per file: writes past `limit` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_full_disk_during_save_keeps_previous_checkpoint(model_config, train_file, two_checkpoints):
    """Resume from checkpoint-4 with files capped at 16 KiB (a model shard is ~45 KiB): saving step 6 fails
    with a clear error, checkpoint-4 stays the newest and loads, and no partial folder is left."""
    out = two_checkpoints
    before = {p.name: p.stat().st_size for p in (out / "checkpoint-4" / "shards").iterdir()}
    result = processes.run([sys.executable, "-m", "plait", "train",
                             *flags(model_config, train_file, out, 6, "--resume_from_checkpoint", "auto")],
                            timeout=120, preexec_fn=_small_files(16 * 1024),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "checkpoint" in last and "File too large" in last, result.stderr[-2000:]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not list(out.glob("*.tmp"))
    assert {p.name: p.stat().st_size for p in (out / "checkpoint-4" / "shards").iterdir()} == before
    pmodel = load_parallel_model(out / "checkpoint-4", ParallelConfig())
    assert all(torch.isfinite(p).all() for p in pmodel.parameters())
