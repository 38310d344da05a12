"""--report_to: experiment trackers (TensorBoard, Weights & Biases, MLflow) that get each step's metrics, as Hugging
Face's Trainer sends them, beside metrics.jsonl.

Each tracker's package is optional (a pip extra of plait); ``parse_report_to`` refuses a name whose package is
missing when the flags are validated, before any process group, rather than at the first step. The packages are
imported only when a tracker opens, so a run that reports nowhere never loads them. The trainer opens the
trackers on rank 0 only. Every step is logged under its own number (the record's "step"), so a resumed run
continues the curve it left; TensorBoard also hides what the interrupted run logged past the checkpoint.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from plait.base.config import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")


def needed_modules(name: str) -> tuple[str, ...]:
    """The modules tracker ``name`` imports: MLflow's default local store is SQLite, which needs SQLAlchemy and
    alembic (mlflow-skinny has neither); a tracking server set by MLFLOW_TRACKING_URI does not."""
    if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        return ("mlflow", "sqlalchemy", "alembic")
    return (name,)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def parse_report_to(value: str) -> list[str]:
    """The trackers of a --report_to value (comma-separated; 'none' or '': none), each known and installed."""
    names = list(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
    if names == ["none"]:
        return []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"--report_to={value!r}: {name!r} is not a tracker; give none, or one or more of "
                              f"{', '.join(TRACKERS)} separated by commas")
        missing = [module for module in needed_modules(name) if not installed(module)]
        if missing:
            raise ConfigError(f"--report_to {name} needs {', '.join(missing)}, not installed here; "
                              f"pip install 'plait[{name}]'")
    return names


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def samples(self, rows: list[dict[str, str]], step: int) -> None: ...

    def close(self, exit_status: int) -> None: ...


class TensorBoard:
    """Event files in <output_dir>/tensorboard (``tensorboard --logdir``). ``purge_step`` makes TensorBoard drop
    the steps from the first one on that an earlier writer logged: a resume, or an older run in the same dir."""

    def __init__(self, output_dir: Path, params: dict, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # here: only a run that reports to it pays the import

        self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=first_step + 1)
        self.writer.add_text("args", "\n".join(f"    {key} = {value!r}" for key, value in params.items()))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def samples(self, rows: list[dict[str, str]], step: int) -> None:
        """--eval_prompts' completions as a Markdown table in the Text tab, one per evaluated step."""
        cell = lambda text: text.replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
        table = ["| prompt | completion |", "| --- | --- |"]
        table += [f"| {cell(row['prompt'])} | {cell(row['completion'])} |" for row in rows]
        self.writer.add_text("samples", "\n".join(table), step)

    def close(self, exit_status: int) -> None:
        self.writer.close()


class WandB:
    """A W&B run in project WANDB_PROJECT (default "plait"), its files under WANDB_DIR (default output_dir), the
    flags as its config; W&B's own variables (WANDB_MODE=offline, WANDB_ENTITY, WANDB_NAME ...) apply as usual."""

    def __init__(self, output_dir: Path, params: dict, first_step: int) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "plait"),
                              dir=os.environ.get("WANDB_DIR", str(output_dir)), config=params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def samples(self, rows: list[dict[str, str]], step: int) -> None:
        import wandb

        table = wandb.Table(columns=["prompt", "completion"], data=[[r["prompt"], r["completion"]] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self, exit_status: int) -> None:
        self.run.finish(exit_code=exit_status)


@contextmanager
def quiet_mlflow() -> Iterator[None]:
    """While plait calls MLflow: MLflow's and alembic's loggers at WARNING at least, and MLflow's artifact progress
    bar off. At MLflow's defaults (INFO, the bar on) a fresh local store printed "Creating initial MLflow database
    tables..." and "Updating database tables", and each --eval_prompts table after the first (``log_table`` downloads
    the table to append to it) a "Downloading artifacts" bar, among the run's step lines. Warnings and errors still
    print; MLFLOW_LOGGING_LEVEL or MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR set by the user is kept. The levels and the
    variable are put back after each call: the loggers are MLflow's, not plait's."""
    bar = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    names = () if os.environ.get("MLFLOW_LOGGING_LEVEL") else ("mlflow", "alembic")
    loggers = {logger: logger.level for logger in map(logging.getLogger, names)}
    set_bar = bar not in os.environ
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    if set_bar:
        os.environ[bar] = "false"
    try:
        yield
    finally:
        for logger, level in loggers.items():
            logger.setLevel(level)
        if set_bar:
            os.environ.pop(bar, None)


class MLflow:
    """An MLflow run at MLFLOW_TRACKING_URI (default ``sqlite:///<output_dir>/mlflow.db``: the kind of store MLflow
    defaults to, kept with the run; its file store refuses to open unless told to), the flags as its params;
    MLFLOW_EXPERIMENT_NAME, MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID apply as usual. In that default store the run's
    experiment ('plait', or MLFLOW_EXPERIMENT_NAME) keeps its artifacts in ``<output_dir>/mlartifacts``: MLflow's
    Default experiment would put them in ./mlruns of whatever directory the command ran in."""

    def __init__(self, output_dir: Path, params: dict, first_step: int) -> None:
        import mlflow  # before quiet_mlflow: the import sets mlflow's logger's level

        with quiet_mlflow():
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                mlflow.set_tracking_uri(f"sqlite:///{(output_dir / 'mlflow.db').resolve()}")
                if not os.environ.get("MLFLOW_EXPERIMENT_ID"):
                    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "plait"
                    if mlflow.get_experiment_by_name(name) is None:
                        mlflow.create_experiment(name, (output_dir / "mlartifacts").resolve().as_uri())
                    mlflow.set_experiment(name)
            self.mlflow = mlflow
            mlflow.start_run()
            mlflow.log_params(params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        with quiet_mlflow():
            self.mlflow.log_metrics(metrics, step=step)

    def samples(self, rows: list[dict[str, str]], step: int) -> None:
        """One table artifact, samples.json, each evaluated step's rows appended (MLflow's log_table appends)."""
        with quiet_mlflow():
            self.mlflow.log_table(data={"step": [step] * len(rows), "prompt": [r["prompt"] for r in rows],
                                        "completion": [r["completion"] for r in rows]}, artifact_file="samples.json")

    def close(self, exit_status: int) -> None:
        with quiet_mlflow():
            self.mlflow.end_run("FINISHED" if exit_status == 0 else "KILLED" if exit_status > 128 else "FAILED")


OPENERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # a flag (``skipped``) is no metric


def scalars(record: dict) -> dict[str, float]:
    """A record's metrics as trackers take them, one number per name: its numbers but the step, and each element
    of a list of numbers (``moe_load``, one per MoE layer) as ``moe_load/0``, ``moe_load/1`` ...: trackers log
    scalars only, and TensorBoard, W&B and MLflow group names by their prefix before "/", so a layer's load
    is a curve of its own in the list's section. Other values (flags, "samples", lists of anything else) stay
    out."""
    metrics: dict[str, float] = {}
    for key, value in record.items():
        if is_number(value) and key != "step":
            metrics[key] = value
        elif isinstance(value, list) and all(map(is_number, value)):
            metrics.update({f"{key}/{index}": element for index, element in enumerate(value)})
    return metrics


class Trackers:
    """The open trackers of a run (none on ranks but 0). A context manager: leaving it closes them all with the
    run's exit status: 0, an exception's ``exit_status`` (plait.run.stop.StopRequested's 128 + the signal: a run
    stopped by a signal, killed rather than failed), else 1."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    @classmethod
    def open(cls, names: list[str], output_dir: Path, params: dict, first_step: int) -> Trackers:
        """Open each named tracker for a run writing to ``output_dir`` whose flags are ``params``, resumed after
        ``first_step`` steps (0: a fresh run). One that cannot start (W&B without a login, an MLflow server out
        of reach) ends the run with one line, the trackers opened before it closed."""
        opened: list[Tracker] = []
        for name in names:
            try:
                opened.append(OPENERS[name](output_dir, params, first_step))
            except Exception as err:
                cls(opened).close(1)
                raise ConfigError(f"--report_to {name} could not start ({type(err).__name__}: {err}); "
                                  f"fix its setup or leave it out of --report_to") from err
        return cls(opened)

    def log(self, record: dict) -> None:
        """A step's record: its numbers (``scalars``) under its "step", and its --eval_prompts completions
        ("samples") as each tracker shows a table."""
        metrics = scalars(record)
        for tracker in self.trackers:
            tracker.log(metrics, record["step"])
            if "samples" in record:
                tracker.samples(record["samples"], record["step"])

    def close(self, exit_status: int) -> None:
        for tracker in self.trackers:
            tracker.close(exit_status)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, *_) -> None:
        self.close(0 if error is None else getattr(error, "exit_status", 1))
