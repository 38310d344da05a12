"""The test launcher (plait.testing.launch): every rank runs as ``python argv`` would, one failure or a hang
ends the whole world with the culprit named, the same whether ranks are fresh processes or forked from the
preloaded server (``PLAIT_LAUNCH=fork``, what this suite's conftest sets)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from plait.base import device
from plait.testing import WorkerFailure, launch
from plait.testing.launcher import LAUNCH_ENV

WORKER = """
import os, sys
preloaded = "transformers.modeling_utils" in sys.modules
import helper_beside_the_script
rank = int(os.environ["RANK"])
print(f"rank={rank} world={os.environ['WORLD_SIZE']} flag={os.environ.get('PLAIT_TEST_FLAG')} "
      f"cwd={os.getcwd()} argv={sys.argv[1:]} preloaded={preloaded} name={__name__}")
mode = sys.argv[1]
if mode == "exit" and rank == 1:
    sys.exit(3)
if mode == "raise" and rank == 1:
    raise RuntimeError("rank one broke")
if mode in ("exit", "raise") and rank == 0:
    import time; time.sleep(60)
if mode == "hang":
    import time; time.sleep(60)
"""


@pytest.fixture(params=["subprocess", "fork"])
def mode(request, monkeypatch, tmp_path):
    monkeypatch.setenv(LAUNCH_ENV, request.param)
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "helper_beside_the_script.py").write_text("")
    return request.param


def test_each_rank_runs_the_script_as_python_would(mode, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    outputs = launch([str(tmp_path / "worker.py"), "ok", "x y"], 2, timeout=120, env={"PLAIT_TEST_FLAG": "on"},
                     cwd=tmp_path / "elsewhere")
    for rank, out in enumerate(outputs):
        assert f"rank={rank} world=2 flag=on cwd={tmp_path / 'elsewhere'} argv=['ok', 'x y']" in out, out
        assert f"preloaded={mode == 'fork'} name=__main__" in out, out


def test_a_module_runs_with_dash_m(mode, tmp_path):
    outputs = launch(["-m", "worker", "ok"], 1, timeout=120, cwd=tmp_path)  # the cwd is on the path, as for -m
    assert "rank=0 world=1" in outputs[0] and "argv=['ok']" in outputs[0], outputs[0]


@pytest.mark.parametrize("how, words", [("exit", "rank 1 exited with code 3"),
                                        ("raise", "RuntimeError: rank one broke")])
def test_one_failing_rank_ends_the_world_and_is_named(mode, tmp_path, how, words):
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="rank 1 exited with code") as failure:
        launch([str(tmp_path / "worker.py"), how], 2, timeout=120)
    assert words in str(failure.value) and "other ranks were stopped" in str(failure.value)
    assert time.monotonic() - start < 50, "rank 0 (sleeping 60 s) was not stopped"


def test_a_hang_is_killed_at_the_timeout(mode, tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"world of 2 timed out after 3s \(a hang\); all ranks killed"):
        launch([str(tmp_path / "worker.py"), "hang"], 2, timeout=3)
    assert time.monotonic() - start < 50


def test_forked_ranks_do_not_share_the_servers_random_state(tmp_path, monkeypatch):
    monkeypatch.setenv(LAUNCH_ENV, "fork")
    (tmp_path / "draw.py").write_text("import random, numpy\nprint('draw', random.random(), numpy.random.rand())\n")
    first, second = launch([str(tmp_path / "draw.py")], 2, timeout=120)
    draw = [line for line in first.splitlines() if line.startswith("draw")]
    assert draw and draw != [line for line in second.splitlines() if line.startswith("draw")]


def test_the_suite_forks_its_worlds():
    """tests/conftest.py turns the fork server on for the whole run (the suite's start-up cost, D8) unless the
    caller chose otherwise (``PLAIT_LAUNCH=subprocess pytest``)."""
    assert os.environ.get(LAUNCH_ENV) in ("fork", "subprocess")


def test_a_caller_whose_main_is_stdin_gets_fresh_processes(tmp_path):
    """multiprocessing imports the caller's main module in each forked rank; ``python -`` has none to import."""
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "helper_beside_the_script.py").write_text("")
    caller = (f"from plait.testing import launch\n"
              f"print(launch([{str(tmp_path / 'worker.py')!r}, 'ok'], 2, timeout=120)[1])\n")
    done = subprocess.run([sys.executable, "-"], input=caller, capture_output=True, text=True, timeout=300,
                          env={**os.environ, LAUNCH_ENV: "fork"})
    assert done.returncode == 0, done.stderr
    assert "rank=1 world=2" in done.stdout and "preloaded=False" in done.stdout, done.stdout


def test_a_machine_with_an_accelerator_gets_fresh_processes(tmp_path, monkeypatch):
    """CUDA cannot start again in a forked child, and the server's imports touch the GPU: measured on an H100,
    every forked rank failed with "Cannot re-initialize CUDA in forked subprocess" (tests/test_gpu.py)."""
    monkeypatch.setenv(LAUNCH_ENV, "fork")
    monkeypatch.setattr(device, "accelerator", lambda: torch.device("cuda"))
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "helper_beside_the_script.py").write_text("")
    assert "preloaded=False" in launch([str(tmp_path / "worker.py"), "ok"], 1, timeout=120)[0]


def test_plait_trains_workers_are_forked_only_without_an_accelerator(monkeypatch):
    """``plait train --nproc_per_node N`` runs torchrun with its workers forked: by torchrun forked from the command
    (``ForkedTorchrun``: ``--run-path --start-method=fork`` and plait/__main__.py; test_signals shows them forked and
    signalled there), or from a fresh torchrun's preloaded server (``--start-method=forkserver``); and as fresh
    ``python -m plait`` processes where an accelerator is present."""
    from plait.run import torchrun

    class Forked:  # a stand-in for the forked torchrun: what it is told to run
        def run(self, argv, env):
            commands.append(argv)
            return 0

    commands = []
    monkeypatch.setattr(torchrun, "supervise", lambda cmd, env=None: commands.append(cmd) or 0)
    torchrun.run_under_torchrun(["train", "--max_steps", "1"], 2, 60, forked=Forked())
    torchrun.run_under_torchrun(["train", "--max_steps", "1"], 2, 60)
    monkeypatch.setattr(device, "accelerator", lambda: torch.device("cuda"))
    torchrun.run_under_torchrun(["train", "--max_steps", "1"], 2, 60)
    main = os.path.abspath(os.path.join(os.path.dirname(torchrun.__file__), os.pardir, "__main__.py"))
    assert commands[0][-6:-3] == ["--run-path", "--start-method=fork", main], commands[0]
    assert commands[1][-6:-3] == ["--run-path", "--start-method=forkserver", main], commands[1]
    assert commands[2][-5:-3] == ["-m", "plait"], commands[2]
    assert not torchrun.ForkedTorchrun.possible()  # pytest's workers have threads: torchrun starts fresh in them


def test_a_forked_torchrun_the_launcher_does_not_start_ends():
    """A refused plan closes the forked torchrun unstarted: it exits at once, having started nothing (run in a
    process of one thread, as ``plait train`` is)."""
    script = ("import os, psutil\n"
              "from plait.run.torchrun import ForkedTorchrun\n"
              "assert ForkedTorchrun.possible()\n"
              "forked = ForkedTorchrun()\n"
              "child = psutil.Process(forked.pid)\n"
              "assert child.ppid() == os.getpid() and not child.children()\n"
              "forked.close()\n"
              "print('gone' if not psutil.pid_exists(forked.pid) else 'left')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "gone", done.stderr[-2000:]
