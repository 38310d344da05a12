"""Stopping `plait train --nproc_per_node 2` with a signal sent to the plait process alone, as a scheduler or a
terminal does: SIGTERM (or a first SIGINT) reaches every worker, which finish the step, save it and stop
together, leaving no process behind, and `--resume_from_checkpoint auto` continues with the one-process losses;
a second SIGINT stops everything at once and the last complete checkpoint stays intact. (Signals sent to
torchrun and its workers directly, by hand or by Slurm: tests/test_examples.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from plait.checkpoint import latest_checkpoint
from plait.cli import build_parser, main
from plait.run.metrics import read_metrics
from plait.run.stop import StopRequested, StopSignals
from plait.run.train_args import TrainArgs, from_namespace
from tiny_models import tiny_config

TIMEOUT = 120
TREE = str(Path(__file__).parent / "workers" / "signal_tree.py")


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return path


def flags(model_config: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_config", str(model_config), "--block_size", "16", "--per_device_train_batch_size", "2",
            "--lr_scheduler_type", "constant", "--output_dir", str(out), *extra]


def steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(read_metrics(out)) if path.exists() else 0


def start_and_signal(args: list[str], out: Path, signals: list[signal.Signals], after_steps: int,
                     env: dict | None = None) -> tuple[int, str, dict[int, tuple[int, str]]]:
    """Start `plait train` (its own session, as from a terminal), send ``signals`` to the plait process alone
    once ``after_steps`` steps are logged; return its exit status, its output and every process it had (pid:
    parent's pid, command line)."""
    log = out.parent / f"{out.name}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "plait", "train", *args], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while steps_done(out) < after_steps:
            assert proc.poll() is None, f"exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no progress:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 4, family  # plait, torchrun, two workers
        seen = {p.pid: (p.ppid(), " ".join(p.cmdline())) for p in family}
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(1.0)
        status = proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"left running: {alive}"
        return status, log.read_text(errors="replace"), seen
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigterm_saves_the_step_and_resume_continues_exactly(model_config, tmp_path):
    out = tmp_path / "run"
    status, output, family = start_and_signal(flags(model_config, out, "--tensor_parallel_size", "2",
                                                    "--nproc_per_node", "2", "--max_steps", "100000"),
                                              out, [signal.SIGTERM], after_steps=3)
    # no accelerator here: torchrun was forked from plait before its plan and forked the two workers
    # (plait.run.torchrun.ForkedTorchrun): one command line throughout, no fresh interpreter; the signal reached them
    plait = next(pid for pid, (parent, _) in family.items() if parent not in family)
    launcher = family[plait][1]
    torchrun = [pid for pid, (parent, _) in family.items() if parent == plait]
    assert len(torchrun) == 1 and family[torchrun[0]][1] == launcher, family
    assert [cmdline for parent, cmdline in family.values() if parent == torchrun[0]] == [launcher] * 2, family
    stopped = len(read_metrics(out))
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert output.count(f"plait: stopped by SIGTERM after step {stopped} of 100000; saved {out}/checkpoint-{stopped};"
                        f" continue with --resume_from_checkpoint auto") == 1, output[-3000:]
    assert "SignalException" not in output and "ChildFailedError" not in output
    assert latest_checkpoint(out) == out / f"checkpoint-{stopped}"

    assert "plait: SIGTERM received: stopping after this step" in output
    assert "layout tp=2 pp=1 dp=1" in output  # plait's launcher ran the workers under torchrun

    # resumed on one process (the checkpoint is layout-free): the losses of one uninterrupted run
    main(["train", *flags(model_config, out, "--resume_from_checkpoint", "auto", "--max_steps", str(stopped + 2))])
    main(["train", *flags(model_config, tmp_path / "one", "--max_steps", str(stopped + 2))])
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, stopped + 3))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in read_metrics(tmp_path / "one")], rel=1e-5)


def test_the_launcher_passes_one_signal_on_and_kills_all_on_a_second(tmp_path):
    """plait's supervision of torchrun (``plait.run.torchrun.supervise``) with a stand-in launcher whose worker
    ignores SIGINT, as a worker busy in a step that never ends: the first SIGINT goes to the worker only, the
    second kills the launcher and its worker at once; SIGTERM alone, passed on, ends a worker that obeys it.
    Last, plait itself is SIGKILLed: its launcher still gets SIGTERM, from the kernel (PR_SET_PDEATHSIG), as
    torchrun does, which then stops its workers as on any SIGTERM (tests/test_examples.py)."""
    cases = [([signal.SIGINT, signal.SIGINT], 130), ([signal.SIGTERM], 143), ([signal.SIGKILL], None)]
    supervisor = subprocess.Popen([sys.executable, TREE, "supervise", str(tmp_path), str(len(cases))],
                                  start_new_session=True)
    family = []
    try:
        for i, (signals, status) in enumerate(cases):
            pids = tmp_path / f"pids-{i}"
            deadline = time.monotonic() + TIMEOUT
            while not pids.exists():
                assert supervisor.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            family = [psutil.Process(int(pid)) for pid in pids.read_text().split()]
            for sig in signals:
                time.sleep(0.3)
                assert all(p.is_running() for p in family), "the first signal must not kill"
                supervisor.send_signal(sig)
            if status is None:  # plait killed: the stand-in launcher ends on the kernel's SIGTERM
                assert family[0].wait(timeout=10) in (None, -signal.SIGTERM)
                break
            _, alive = psutil.wait_procs(family, timeout=10)
            assert not alive
            while not (tmp_path / f"pids-{i}.status").exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert int((tmp_path / f"pids-{i}.status").read_text()) == status
    finally:
        for proc in family:  # the stand-in launcher does not pass SIGTERM on as torchrun does: its worker stays
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait()


def test_a_second_sigint_in_a_worker_stops_at_once():
    with StopSignals(announce=False, grace_s=60) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's repeat: still one graceful stop
        assert signals.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)




def test_one_process_stops_at_the_step_and_no_save_on_signal_saves_nothing(model_config, tmp_path):
    """In one process (no torchrun): SIGTERM during step 3 stops the run after it; --no_save_on_signal leaves
    only the checkpoint --save_steps 2 wrote, and the line names it."""
    from plait.run.trainer import Trainer

    args = from_namespace(build_parser().parse_args(["train", *flags(model_config, tmp_path, "--max_steps", "10",
                                                                     "--save_steps", "2", "--no_save_on_signal")]),
                          TrainArgs)
    assert args.save_on_signal is False and TrainArgs().save_on_signal is True
    trainer = Trainer(args)
    step = trainer.step

    def signal_then_step(n: int) -> dict:
        if n == 2:  # during step 3 (0-based 2), after --save_steps 2 saved step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return step(n)

    trainer.step = signal_then_step
    with pytest.raises(StopRequested) as stop:
        trainer.train()
    assert str(stop.value) == (f"stopped by SIGTERM after step 3 of 10; no checkpoint saved (--no_save_on_signal); "
                               f"the last is {tmp_path}/checkpoint-2")
    assert stop.value.exit_status == 143 and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back
