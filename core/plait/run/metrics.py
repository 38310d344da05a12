"""What a run records: metrics.jsonl (one object per step), peak memory, and a loss-curve picture."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch

from plait.base import comm
from plait.run.runtime import is_main_process


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


def plot_loss_curve(history: list[dict], path: Path) -> bool:
    """Write the training (and eval) loss per step as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train loss")
    evals = [r for r in history if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return True


def read_metrics(output_dir: str | Path, event: str | None = None) -> list[dict]:
    """The records of a run's metrics.jsonl: optimizer steps by default, or the records of one ``event``
    (e.g. "load": how long loading took and its peak memory)."""
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in records if r.get("event") == event]
