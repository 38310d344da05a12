"""PLAIT_SINGLETON_GROUPS=1 on gloo: a one-rank world with real one-rank groups (the path the GPU tests use
on NCCL) calls the collectives and trains exactly like a plain single process."""

from __future__ import annotations

from plait.run.metrics import read_metrics
from plait.testing.launcher import launch

ARGS = ["-m", "plait", "train", "--device", "cpu", "--max_steps", "3", "--per_device_train_batch_size", "4",
        "--block_size", "32", "--bf16"]


def test_singleton_groups_train_like_one_process(tmp_path):
    """ZeRO-1 runs over the one-rank groups (a plain single process refuses it: nothing to shard)."""
    launch([*ARGS, "--output_dir", str(tmp_path / "plain")], 1, timeout=300)
    launch([*ARGS, "--output_dir", str(tmp_path / "groups"), "--save_steps", "3", "--zero_1"], 1, timeout=300,
           env={"PLAIT_SINGLETON_GROUPS": "1"})
    plain, groups = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "groups")
    assert [r["loss"] for r in plain] == [r["loss"] for r in groups]
    assert (tmp_path / "groups" / "checkpoint-3").is_dir()  # object collectives of the save ran on the group


def test_unknown_attention_kernel_is_refused_with_the_choices():
    import pytest

    from plait.base.config import ConfigError
    from plait.run.model_config import read_model_config
    from plait.run.train_args import TrainArgs

    with pytest.raises(ConfigError, match="attn_implementation='flash9' is unknown; choose one of eager, .*sdpa"):
        read_model_config(TrainArgs(attn_implementation="flash9"))
    assert read_model_config(TrainArgs(attn_implementation="sdpa"))._attn_implementation == "sdpa"
