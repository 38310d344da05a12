"""What a run records: metrics.jsonl (one object per step), peak memory, and a loss-curve picture."""

from __future__ import annotations

import importlib.util
import json
import math
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from plait.base import comm
from plait.run.runtime import is_main_process

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class MetricsLog:
    """metrics.jsonl, one JSON object per line, written by rank 0 only (appending, so a resumed run
    continues the file)."""

    def __init__(self, output_dir: Path, fresh: bool = True) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.enabled = is_main_process()
        if self.enabled:
            output_dir.mkdir(parents=True, exist_ok=True)
            if fresh or not self.path.exists():
                self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json_line(record) + "\n")


def json_line(record: dict) -> str:
    """``record`` as strict JSON: a non-finite number (which ``json.dumps`` writes as a bare ``NaN`` that jq and
    strict parsers reject) becomes null, and its key is listed under ``"nonfinite"``."""
    bad = [key for key, value in record.items() if isinstance(value, float) and not math.isfinite(value)]
    if bad:
        record = {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}
    return json.dumps(record, allow_nan=False)


def peak_rss_mb() -> float:
    """The largest peak resident memory of any rank, in MiB (a collective over the whole world)."""
    return world_max([own_peak_rss_mb()])[0]


def own_peak_rss_mb() -> float:
    """This process's peak resident memory, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def world_max(values: list[float]) -> list[float]:
    """The largest of each value over every rank, in one collective (the trainer folds its per-step flags into
    the one that reports peak memory, rather than paying a collective for each)."""
    world = comm.world_group()
    own = torch.tensor(values, dtype=torch.float64, device=comm.device_for(world))
    return comm.all_reduce(own, world, op="max").tolist()


def world_rows(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, in rank order, in one collective (the trainer's per-step one: the maxima of its
    flags and the step time of each rank, for naming stragglers, come from the same gather)."""
    world = comm.world_group()
    own = torch.tensor([values], dtype=torch.float64, device=comm.device_for(world))
    return comm.all_gather(own, world, dim=0).tolist()


@dataclass
class LossCurve:
    """What loss.png draws: the training loss of each step, the eval loss of each evaluated step (NaN where a loss
    was not finite, null in metrics.jsonl), and the skipped steps (not applied: a non-finite loss or gradient)."""

    steps: list[int]
    loss: list[float]
    eval_steps: list[int]
    eval_loss: list[float]
    skipped: list[int]


def loss_curve(records: list[dict]) -> LossCurve:
    """The curve of a run from its metrics.jsonl's records, in the file's order. A resumed run appends to the file
    of the run it resumed, which may have logged steps past the checkpoint before it stopped; the resume's load
    record (``{"event": "load", "step": N}``) drops those records of steps after N, so each step is drawn from the
    run that went on, its evaluations too."""
    kept: dict[int, dict] = {}
    for record in records:
        if record.get("event") == "load":
            kept = {step: kept_record for step, kept_record in kept.items() if step <= record["step"]}
        elif "event" not in record:
            kept[record["step"]] = record
    ordered = [kept[step] for step in sorted(kept)]
    evals = [r for r in ordered if "eval_loss" in r]
    return LossCurve(steps=[r["step"] for r in ordered], loss=[nan_if_null(r["loss"]) for r in ordered],
                     eval_steps=[r["step"] for r in evals], eval_loss=[nan_if_null(r["eval_loss"]) for r in evals],
                     skipped=[r["step"] for r in ordered if r.get("skipped")])


def nan_if_null(value: float | None) -> float:
    """A loss as matplotlib leaves a gap for: metrics.jsonl writes a non-finite one as null."""
    return math.nan if value is None else value


def curve_figure(curve: LossCurve) -> Figure:
    """``curve`` drawn, its points marked: a loss between two non-finite ones has no line segment to show it, so a
    run with one finite loss would be blank. The skipped steps are crosses along the bottom (their loss may have
    no value to place them at). A bare Figure, not pyplot's: no backend to choose, no global figure to close."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(curve.steps, curve.loss, ".-", markersize=4, label="train loss")
    if curve.eval_steps:
        ax.plot(curve.eval_steps, curve.eval_loss, "o-", label="eval loss")
    if curve.skipped:
        ax.plot(curve.skipped, [0.0] * len(curve.skipped), "x", color="red", clip_on=False,
                transform=ax.get_xaxis_transform(), label="skipped step")  # x in steps, y at the axes' bottom
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_loss_curve(history: list[dict], path: Path) -> bool:
    """Write the training (and eval) loss per step as a PNG; False when matplotlib is not installed. The curve is
    the whole run's, from the metrics.jsonl beside ``path`` (the trainer's output dir), so a resumed run's picture
    starts at step 1 rather than at the resume; ``history`` (this process's records) only where there is none."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    records = read_records(path.parent) if (path.parent / "metrics.jsonl").exists() else history
    tmp = path.with_suffix(".tmp.png")
    curve_figure(loss_curve(records)).savefig(tmp, dpi=100)
    tmp.replace(path)
    return True


def read_records(output_dir: str | Path) -> list[dict]:
    """Every record of a run's metrics.jsonl, steps and events, in the file's order."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]


def read_metrics(output_dir: str | Path, event: str | None = None) -> list[dict]:
    """The records of a run's metrics.jsonl: optimizer steps by default, or the records of one ``event``
    (e.g. "load": how long loading took and its peak memory)."""
    return [r for r in read_records(output_dir) if r.get("event") == event]
