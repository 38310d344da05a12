"""loss.png: the whole run's curve from metrics.jsonl, a resume's abandoned steps left out, and points a line
cannot show (one finite loss between non-finite ones, skipped steps) still drawn."""

from __future__ import annotations

import json
import math
import sys

import pytest

from plait.run import metrics
from plait.run.metrics import curve_figure, loss_curve, plot_loss_curve, read_records


def write_jsonl(path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_resumed_runs_curve_is_the_run_that_went_on(tmp_path, monkeypatch):
    """Steps 1-4 (an evaluation at 2 and 4), then a resume from the checkpoint of step 2 that logs 3-6: the curve
    is steps 1-6, 3 and 4 (and 4's evaluation) the resumed run's, drawn from the file, not this process's history."""
    first = [{"step": s, "loss": 10.0 - s, **({"eval_loss": 20.0 - s} if s % 2 == 0 else {})} for s in range(1, 5)]
    resumed = [{"step": s, "loss": 5.0 - s / 10, **({"eval_loss": 9.0 - s / 10} if s % 2 == 0 else {})}
               for s in range(3, 7)]
    write_jsonl(tmp_path / "metrics.jsonl", [{"event": "load", "step": 0, "source": "init"}, *first,
                                             {"event": "load", "step": 2, "source": "checkpoint-2"}, *resumed])
    curve = loss_curve(read_records(tmp_path))
    assert curve.steps == [1, 2, 3, 4, 5, 6]
    assert curve.loss == pytest.approx([9.0, 8.0, 4.7, 4.6, 4.5, 4.4])
    assert curve.eval_steps == [2, 4, 6] and curve.eval_loss == pytest.approx([18.0, 8.6, 8.4])
    assert curve.skipped == []
    drawn = []
    monkeypatch.setattr(metrics, "curve_figure", lambda curve: drawn.append(curve) or curve_figure(curve))
    assert plot_loss_curve(resumed[-2:], tmp_path / "loss.png")  # the trainer's call: this session's records
    assert drawn == [curve] and (tmp_path / "loss.png").stat().st_size > 1000


def test_a_resume_drops_the_abandoned_steps_it_did_not_reach_again(tmp_path):
    """A run that logged 1-5, resumed from step 2 and stopped after 3: step 4 and 5 were never the run's."""
    write_jsonl(tmp_path / "metrics.jsonl", [*({"step": s, "loss": 1.0} for s in range(1, 6)),
                                             {"event": "load", "step": 2}, {"step": 3, "loss": 0.5}])
    assert loss_curve(read_records(tmp_path)).loss == [1.0, 1.0, 0.5]


def test_a_single_finite_loss_is_drawn_and_skipped_steps_are_marked(tmp_path):
    """Steps 1 and 3 skipped (a NaN loss in memory, null in metrics.jsonl): step 2's loss alone has no segment, so
    the line has markers; the skipped steps are crosses at the bottom."""
    history = [{"step": 1, "loss": math.nan, "skipped": True}, {"step": 2, "loss": 2.0},
               {"step": 3, "loss": None, "nonfinite": ["loss"], "skipped": True}]
    curve = loss_curve(history)
    assert curve.steps == [1, 2, 3] and curve.loss[1] == 2.0 and all(map(math.isnan, curve.loss[::2]))
    assert curve.skipped == [1, 3]
    train, skipped = curve_figure(curve).axes[0].lines
    assert train.get_label() == "train loss" and train.get_marker() not in (None, "None", "", " ")
    assert skipped.get_label() == "skipped step" and list(skipped.get_xdata()) == [1, 3]
    # without a metrics.jsonl beside the picture, the records given are drawn
    assert plot_loss_curve(history, tmp_path / "loss.png") and (tmp_path / "loss.png").stat().st_size > 1000


def test_no_picture_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: find_spec finds nothing
    assert not plot_loss_curve([{"step": 1, "loss": 1.0}], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()
