"""Issue 47.3: replica groups on torchft keep training when one of them dies, and a replacement rejoins.

A lighthouse on the loopback (torchft's, started and stopped here); two replica groups of one process each
(``plait train --fault_tolerance torchft --replica_group_id K --num_replica_groups 2``). Group 1 is SIGKILLed at
its step 10 (``PLAIT_FAULT_INJECT``, as an out-of-memory killer would); group 0, slowed to 0.3 s a step so that
the replacement can rejoin in time, steps on in the same process; group 1 started again takes group 0's state at
the next quorum and both end with the same weights and optimizer state, tensor for tensor.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plait.cli import main
from plait.run.metrics import read_metrics
from plait.testing import WorkerFailure, launch
from plait.testing.metrics_watch import MetricsWatch
from tiny_models import tiny_config

STEPS, KILLED_AT = 50, 10


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=100)
    yield server.address()
    server.shutdown()


def flags(config: Path, out: Path, group: int) -> list[str]:
    return ["-m", "plait", "train", "--model_config", str(config), "--output_dir", str(out), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "2", "--block_size", "16", "--fault_tolerance", "torchft",
            "--replica_group_id", str(group), "--num_replica_groups", "2", "--ddp_timeout", "30"]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(checkpoint.rglob("*.safetensors")):
        found.update(load_file(path))
    return found


@pytest.mark.slow
def test_a_killed_group_leaves_the_other_training_and_its_replacement_rejoins(lighthouse, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(tiny_config("llama").to_json_string())
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    survivor, outcome = tmp_path / "group0", {}

    def run_survivor() -> None:
        try:
            outcome["output"] = launch(flags(config, survivor, 0), 1, timeout=300,
                                       env={**env, "PLAIT_FAULT_INJECT": "0:1-1000:sleep", "PLAIT_FAULT_SLEEP": "0.3"})
        except Exception as err:  # noqa: BLE001 (re-raised in the test's thread below)
            outcome["error"] = err

    watch = MetricsWatch(survivor / "metrics.jsonl")
    thread = threading.Thread(target=run_survivor)
    thread.start()
    with pytest.raises(WorkerFailure, match="exited with code -9"):
        launch(flags(config, tmp_path / "group1", 1), 1, timeout=300,
               env={**env, "PLAIT_FAULT_INJECT": f"0:{KILLED_AT}:kill"})
    killed = time.monotonic()
    # the first step group 0 commits alone after the kill (the replacement starts after it: joining at once, it would
    # make the next quorum whole again)
    alone = watch.first(lambda r: r.get("replica_groups") == 1 and r.get("committed", True) and r["step"] > KILLED_AT,
                        timeout=60)
    alone = None if alone is None else alone - killed
    replacement = launch(flags(config, tmp_path / "group1-again", 1), 1, timeout=300, env=env)
    thread.join(timeout=300)
    watch.stop()
    assert "error" not in outcome, outcome.get("error")
    assert alone is not None and alone < 10, f"group 0 committed no step alone within 10 s of the kill ({alone})"
    print(f"group 0 committed a step alone {alone:.1f} s after group 1 was killed")

    records = read_metrics(survivor)
    start = records[0]["step"]  # 1, or a later step where group 1 was ahead at the first quorum: it took its state
    assert start < KILLED_AT and [r["step"] for r in records] == list(range(start, STEPS + 1)), \
        "group 0 ran every step from its first quorum on, in one process"
    lost = [r["step"] for r in records if r.get("committed") is False]
    assert len(lost) <= 1 and all(KILLED_AT - 1 <= step <= KILLED_AT for step in lost), lost
    groups = [r["replica_groups"] for r in records if r.get("committed", True)]
    assert 1 in groups and groups[-1] == 2, groups
    joined = [line for line in replacement[0].splitlines() if line.startswith("replica group 1 joined")]
    assert len(joined) == 1, replacement[0][-3000:]
    first = read_metrics(tmp_path / "group1-again")[0]["step"]
    assert KILLED_AT < first < STEPS and f"at step {first}," in joined[0], (first, joined)

    ours, theirs = tensors(survivor / f"checkpoint-{STEPS}"), tensors(tmp_path / "group1-again" / f"checkpoint-{STEPS}")
    assert sorted(ours) == sorted(theirs) and len(ours) > 20
    assert all(torch.equal(ours[name], theirs[name]) for name in ours), \
        [name for name in ours if not torch.equal(ours[name], theirs[name])][:5]


def test_bad_replica_group_flags_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(tiny_config("llama").to_json_string())
    base = ["train", "--model_config", str(config), "--output_dir", str(tmp_path / "out")]
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cases = [
        (["--replica_group_id", "1", "--num_replica_groups", "2"], "need --fault_tolerance torchft"),
        (["--fault_tolerance", "torchft", "--replica_group_id", "2", "--num_replica_groups", "2"],
         "--replica_group_id 2 is not one of the 2 groups of --num_replica_groups (0 to 1)"),
        (["--fault_tolerance", "torchft", "--num_replica_groups", "2"],
         "the lighthouse's address in TORCHFT_LIGHTHOUSE"),
        (["--fault_tolerance", "raft"], "--fault_tolerance='raft' is unknown; choose none or torchft"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, extra
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    with pytest.raises(SystemExit):
        main([*base, "--fault_tolerance", "torchft", "--zero_stage", "1"])
    assert "not with ZeRO (--zero_stage / --zero_1)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
