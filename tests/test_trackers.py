"""--report_to: one real ``plait train`` run reports to TensorBoard, W&B (offline) and MLflow (a local SQLite
store), and each tracker, read back with its own reader, holds metrics.jsonl's values at metrics.jsonl's steps and
its --eval_prompts completions as a table; the same run's stderr (not a terminal) holds one readable line per
--logging_steps. Then the refusals, in one line.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import struct
from pathlib import Path

import pytest

from plait.base.config import ConfigError
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run import trackers
from plait.run.metrics import read_metrics
from plait.run.stop import StopRequested
from plait.run.trackers import Trackers, parse_report_to
from plait.run.train_args import TrainArgs
from plait.testing import launch
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """A 4-step run with an evaluation at steps 2 and 4 (the loss and two prompts' completions), its metrics to
    every tracker; its dir and its output."""
    out = tmp_path_factory.mktemp("tracked")
    config = out / "config.json"
    config.write_text(tiny_config("llama", vocab_size=320).to_json_string())
    validation = out / "validation.txt"
    validation.write_text("To be, or not to be, that is the question.\n" * 20)
    save_chat_tokenizer(["To be, or not to be, that is the question."] * 20, 300, out / "tokenizer")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(out / "wandb-dir"),
           "WANDB_PROJECT": "plait-test", "MLFLOW_TRACKING_URI": ""}
    (out / "wandb-dir").mkdir()
    (out / "prompts.jsonl").write_text('{"prompt": "To be, or"}\n{"prompt": "that is | the"}\n')
    output = launch(["-m", "plait", "train", "--model_config", str(config), "--output_dir", str(out / "run"),
                     "--max_steps", "4", "--per_device_train_batch_size", "2", "--block_size", "16",
                     "--validation_file", str(validation), "--tokenizer_name", str(out / "tokenizer"),
                     "--logging_steps", "2", "--eval_steps", "2",
                     "--eval_prompts", str(out / "prompts.jsonl"), "--eval_max_new_tokens", "5",
                     "--report_to", "tensorboard,wandb,mlflow"], 1, timeout=180, env=env)[0]
    return out, output


def steps(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "run")}


def test_log_lines_without_a_terminal(run):
    out, output = run
    lines = [line for line in output.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, output  # --logging_steps 2 of 4 steps
    record = steps(out)[4]
    assert lines[1].startswith(f"step 4/4 | loss {record['loss']:.4f} | eval_loss {record['eval_loss']:.4f} | "
                               f"eval_ppl {record['eval_ppl']:.2f} | lr {record['lr']:.1e} | "), lines[1]
    assert re.search(r" \| [\d,]+ tok/s \| eta 0s$", lines[1]), lines[1]
    assert not any(line.lstrip().startswith("{") for line in output.splitlines()), output


def test_the_trackers_print_nothing_among_the_runs_lines(run):
    """The run's output holds plait's lines only (the data, the layout, the steps, "saved ..."): MLflow's INFO lines
    ("INFO mlflow.store.db.utils: Creating initial MLflow database tables...", "... Updating database tables": its
    fresh SQLite store), alembic's, and the "Downloading artifacts" bar of the second --eval_prompts table once
    came among the step lines. Read from the module's one run: no launch of its own."""
    _, output = run
    noise = [line for line in output.splitlines() if re.search(r"\bINFO\b|alembic|Downloading artifacts", line)]
    assert not noise, output


def test_tensorboard_has_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = run
    events = EventAccumulator(str(out / "run" / "tensorboard"))
    events.Reload()
    records = steps(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert {e.step: e.value for e in events.Scalars(key)} == \
            pytest.approx({step: r[key] for step, r in records.items()}, rel=1e-6)  # stored as float32
    assert {e.step: e.value for e in events.Scalars("eval_loss")} == \
        pytest.approx({step: records[step]["eval_loss"] for step in (2, 4)})
    assert "args/text_summary" in events.Tags()["tensors"]
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}
    assert sorted(tables) == [2, 4]
    cell = lambda text: text.replace("|", "\\|").replace("\n", "<br>")  # noqa: E731 (a cell on one line)
    for step, table in tables.items():
        rows = [f"| {cell(s['prompt'])} | {cell(s['completion'])} |" for s in records[step]["samples"]]
        assert table == "\n".join(["| prompt | completion |", "| --- | --- |", *rows])


def test_each_evaluation_has_the_prompts_completions(run):
    out, _ = run
    records = steps(out)
    assert [step for step, r in records.items() if "samples" in r] == [2, 4]
    for step in (2, 4):
        assert [s["prompt"] for s in records[step]["samples"]] == ["To be, or", "that is | the"]
        assert all(isinstance(s["completion"], str) for s in records[step]["samples"])


def wandb_records(path: Path):
    """The records of a W&B run file (``run-ID.wandb``): LevelDB's log format (32 KiB blocks; each piece of a
    record behind a 7-byte header: CRC, length, kind) after W&B's 7-byte file header. The wandb package no longer
    ships a Python reader; the records are its own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pieces = path.read_bytes(), 32768, 7, b""
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def test_wandb_offline_run_has_the_metrics(run):
    out, _ = run
    [path] = (out / "wandb-dir" / "wandb").glob("offline-run-*/run-*.wandb")  # WANDB_DIR, not output_dir
    history, config = {}, {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = items
        elif record.WhichOneof("record_type") == "run":
            assert record.run.project == "plait-test"
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    records = steps(out)
    assert sorted(history) == sorted(records)
    for step, record in records.items():
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
        assert {k: history[step][k] for k in numbers} == numbers
        if "samples" in record:  # a wandb.Table: its rows in a json file of the run's media
            table = json.loads((path.parent / "files" / history[step]["samples/path"]).read_text())
            assert table["columns"] == ["prompt", "completion"]
            assert table["data"] == [[s["prompt"], s["completion"]] for s in record["samples"]]
    assert [step for step in history if "samples/path" in history[step]] == [2, 4]
    assert config["report_to"] == "tensorboard,wandb,mlflow" and config["max_steps"] == 4


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")  # mlflow 3.17's SQL store on SQLAlchemy 2.1
def test_mlflow_run_has_the_metrics(run):
    from mlflow.tracking import MlflowClient

    out, _ = run
    client = MlflowClient(f"sqlite:///{out / 'run' / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("plait").experiment_id])
    # its artifacts beside the store, not in ./mlruns of the directory the command ran in
    assert (out / "run" / "mlartifacts").is_dir() and not (Path.cwd() / "mlruns").exists()
    assert found.info.status == "FINISHED" and found.data.params["max_steps"] == "4"
    records = steps(out)
    for key in ("loss", "lr", "grad_norm"):
        history = client.get_metric_history(found.info.run_id, key)
        assert {m.step: m.value for m in history} == {step: r[key] for step, r in records.items()}
    table = json.loads(Path(client.download_artifacts(found.info.run_id, "samples.json", str(out))).read_text())
    assert table == {"columns": ["step", "prompt", "completion"],
                     "data": [[step, s["prompt"], s["completion"]] for step in (2, 4) for s in records[step]["samples"]]}


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    """A run stopped after step 3 and resumed from its checkpoint of step 2 logs step 3 again: TensorBoard shows
    the resumed run's step 3, once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for first_step, losses in ((0, [3.0, 2.0, 1.5]), (2, [1.4, 1.2])):
        with Trackers.open(["tensorboard"], tmp_path, {"seed": 0}, first_step) as opened:
            for step, loss in enumerate(losses, start=first_step + 1):
                opened.log({"step": step, "loss": loss, "moe_load": [1.0], "skipped": True})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([3.0, 2.0, 1.4, 1.2])
    assert events.Tags()["scalars"] == ["loss", "moe_load/0"]  # the list per element, not the flag


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")  # mlflow 3.17's SQL store on SQLAlchemy 2.1
def test_a_list_of_numbers_reaches_each_tracker_per_element(tmp_path, monkeypatch):
    """moe_load (each MoE layer's load) as moe_load/0, moe_load/1 in TensorBoard, W&B and MLflow, read back from
    their files; a list of anything else (the layers' names) and a flag stay out."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    loads = {1: [1.5, 1.25], 2: [1.125, 2.0]}
    with Trackers.open(["tensorboard", "wandb", "mlflow"], tmp_path, {"seed": 0}, 0) as opened:
        for step, load in loads.items():
            opened.log({"step": step, "loss": 2.0 / step, "moe_load": load, "moe_layers": ["mlp.0", "mlp.1"],
                        "skipped": False})
    expected = {f"moe_load/{layer}": {step: load[layer] for step, load in loads.items()} for layer in (0, 1)}
    expected["loss"] = {1: 2.0, 2: 1.0}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {key: {e.step: e.value for e in events.Scalars(key)} for key in events.Tags()["scalars"]} == expected
    [path] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    logged: dict[str, dict[int, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own (_step, _runtime, _timestamp)
                    logged.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    assert logged == expected
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("plait").experiment_id])
    assert {key: {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
            for key in found.data.metrics} == expected


def test_a_tracker_that_cannot_start_ends_the_run_in_one_line(tmp_path, monkeypatch):
    closed = []

    class Opened:
        def __init__(self, *_):
            pass

        def close(self, exit_status):
            closed.append(exit_status)

    def refuse(*_):
        raise RuntimeError("No API key configured")

    monkeypatch.setattr(trackers, "OPENERS", {"tensorboard": Opened, "wandb": refuse})
    with pytest.raises(ConfigError, match=r"^--report_to wandb could not start \(RuntimeError: No API key "
                                          r"configured\); fix its setup or leave it out of --report_to$"):
        Trackers.open(["tensorboard", "wandb"], tmp_path, {}, 0)
    assert closed == [1]


@pytest.mark.parametrize("error, status", [(None, 0), (ValueError("bug"), 1),
                                           (StopRequested(signal.SIGTERM, 3, 6, "out/checkpoint-3", None), 143)])
def test_trackers_close_with_the_runs_exit_status(tmp_path, monkeypatch, error, status):
    """W&B gets it as the run's exit code, MLflow as FINISHED, FAILED or (a signal's stop) KILLED."""
    closed = []

    class Opened:
        def __init__(self, *_):
            pass

        def close(self, exit_status):
            closed.append(exit_status)

    monkeypatch.setattr(trackers, "OPENERS", {"wandb": Opened})
    with pytest.raises(type(error)) if error else contextlib.nullcontext():
        with Trackers.open(["wandb"], tmp_path, {}, 0):
            if error:
                raise error
    assert closed == [status]


@pytest.mark.parametrize("value, names", [("none", []), ("", []), ("wandb, tensorboard,wandb", ["wandb", "tensorboard"])])
def test_report_to_names(value, names):
    assert parse_report_to(value) == names


@pytest.mark.parametrize("value", ["comet", "none,wandb"])
def test_an_unknown_tracker_is_refused_in_one_line(value):
    bad = value.split(",")[0]
    with pytest.raises(ConfigError, match=rf"^--report_to='{value}': '{bad}' is not a tracker; give none, or one or "
                                          r"more of tensorboard, wandb, mlflow separated by commas$"):
        TrainArgs(report_to=value).validate()


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(trackers, "installed", lambda module: module not in ("wandb", "alembic"))
    with pytest.raises(ConfigError, match=r"^--report_to wandb needs wandb, not installed here; "
                                          r"pip install 'plait\[wandb\]'$"):
        TrainArgs(report_to="tensorboard,wandb").validate()
    with pytest.raises(ConfigError, match=r"^--report_to mlflow needs alembic, not installed here; "
                                          r"pip install 'plait\[mlflow\]'$"):
        TrainArgs(report_to="mlflow").validate()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")  # a server: no local store needed
    assert parse_report_to("mlflow") == ["mlflow"]
