"""The console's line per --logging_steps where stderr is not a terminal: what it shows of a step's record."""

from __future__ import annotations

import pytest

from plait.run.log_line import duration, log_line

RECORD = {"step": 12, "loss": 4.12341, "lr": 9e-4, "grad_norm": 0.81234, "tokens_per_s": 12345.4, "peak_rss_mb": 600.0}


def test_a_step():
    assert log_line(RECORD, 100, 0.7333) == \
        "step 12/100 | loss 4.1234 | lr 9.0e-04 | grad_norm 0.812 | 12,345 tok/s | eta 1m05s"


def test_evaluation_skipped_steps_and_moe_load():
    record = {**RECORD, "step": 100, "eval_loss": 3.5, "eval_ppl": 33.1155, "grad_norm": float("inf"), "skipped": True,
              "skipped_steps": 2, "moe_load_max_over_mean": 1.256, "moe_load": [1.256, 1.1]}
    assert log_line(record, 100, 1.0) == ("step 100/100 | loss 4.1234 | eval_loss 3.5000 | eval_ppl 33.12 | lr 9.0e-04 | "
                                          "grad_norm inf | not applied (non-finite) | skipped 2 | moe max/mean 1.26 | "
                                          "12,345 tok/s | eta 0s")


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (59.4, "59s"), (62, "1m02s"), (3599, "59m59s"),
                                           (3600, "1h00m"), (11_100, "3h05m"), (100 * 3600, "100h00m")])
def test_duration(seconds, text):
    assert duration(seconds) == text
