"""Issue 30: ``plait train --layout auto`` trains with the layout ``plait plan --search`` ranks first for this run."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import pytest
from rich.console import Console

import processes
from plait.auto_layout import choose_layout
from plait.base.config import ConfigError
from plait.cli import build_parser
from plait.costs.device import PRESETS
from plait.run.metrics import read_metrics
from plait.run.train_args import TrainArgs, from_namespace
from tiny_models import tiny_config

DEVICE = dataclasses.replace(PRESETS["cpu"], reserve_bytes=0)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return str(path)


def args_of(*flags: str) -> TrainArgs:
    return from_namespace(build_parser().parse_args(["train", *flags]), TrainArgs)


def test_the_choice_is_the_searchs_first_with_its_batch_split(model_config, capsys):
    from plait.plan_command import run_plan

    flags = ["--model_config", model_config, "--block_size", "16", "--per_device_train_batch_size", "4"]
    console = Console(stderr=True, width=200)
    chosen = choose_layout(args_of(*flags), 2, DEVICE, console)
    err = capsys.readouterr().err
    assert "--layout auto: the fastest of" in err and "--layout auto chose #1," in err
    assert " 1 │" in err and " 3 │" in err  # the top 3 with their numbers
    # the same flags ``plait plan --search`` prints as its best command, on the same device model
    ns = build_parser().parse_args(["plan", *flags, "--world_size", "2", "--search", "--hardware", "cpu", "--json",
                                    "--device_memory", str(DEVICE.memory_bytes / 2**30)])
    import json
    run_plan(ns, from_namespace(ns, TrainArgs))
    best = json.loads(capsys.readouterr().out)["command"]
    assert " ".join(chosen) in best


def test_the_chosen_split_keeps_the_global_batch_as_written(model_config):
    """The chosen flags go after the user's, so they give the accumulation steps even at 1: a
    --gradient_accumulation_steps the user gave survived beside a chosen split of the same batch and doubled it."""
    flags = ["--model_config", model_config, "--block_size", "16", "--per_device_train_batch_size", "3",
             "--gradient_accumulation_steps", "2"]
    for world in (1, 2):
        chosen = args_of(*flags, *choose_layout(args_of(*flags), world, DEVICE, Console(stderr=True)))
        dp = world // (chosen.tensor_parallel_size * chosen.pipeline_parallel_size * chosen.context_parallel_size)
        assert chosen.per_device_train_batch_size * chosen.gradient_accumulation_steps * dp == 6 * world, chosen


def test_a_layout_flag_beside_auto_is_refused(model_config):
    with pytest.raises(ConfigError, match="--layout auto chooses --tensor_parallel_size itself; drop it"):
        choose_layout(args_of("--model_config", model_config, "--tensor_parallel_size", "2"), 2, DEVICE)


@pytest.mark.slow
def test_plait_train_layout_auto_trains_with_the_choice(model_config, tmp_path):
    out = tmp_path / "out"
    result = processes.run([sys.executable, "-m", "plait", "train", "--layout", "auto", "--nproc_per_node", "2",
                            "--model_config", model_config, "--output_dir", str(out), "--max_steps", "2",
                            "--block_size", "16", "--per_device_train_batch_size", "4", "--no_save_final"],
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    chose = next(line for line in result.stderr.splitlines() if "--layout auto chose #1," in line)
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert result.stderr.count("train data: ") == 1, result.stderr  # the launcher said it; its workers do not
    started = next(line for line in result.stderr.splitlines() if line.startswith("plait layout "))
    sizes = lambda text: re.findall(r"\b(tp|pp|dp)=(\d+)", text)  # noqa: E731
    assert sizes(chose) == sizes(started), (chose, started)  # the workers run the layout chosen
