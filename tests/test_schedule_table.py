"""The pipeline schedules are one table (plait.base.pipeline_schedules.SCHEDULES): a row added there is a choice
of the config, checked by the runner, costed by the planner and tried by the layout search, with nothing else
edited. Also the rows of the table agree with the facts they encode."""

from __future__ import annotations

import pytest

from plait.base.config import ConfigError, ParallelConfig
from plait.base.pipeline_schedules import SCHEDULES, Schedule
from plait.costs.bubble import bubble_fraction, in_flight
from plait.costs.search import candidates
from plait.pipeline.runner import check_schedule


@pytest.fixture
def looped(monkeypatch) -> str:
    """A new looped schedule, torch's interleaved 1F1B under another name, leaving half the bubble idle."""
    monkeypatch.setitem(SCHEDULES, "looped-half", Schedule("ScheduleInterleaved1F1B", multi_stage=True,
                                                           min_virtual=2, bubble_share=0.5))
    return "looped-half"


def test_a_new_row_is_a_schedule_everywhere(looped):
    config = ParallelConfig(pp=2, dp=1, pipeline_schedule=looped, virtual_pipeline_size=2, num_microbatches=4)
    check_schedule(config)
    assert bubble_fraction(config) == pytest.approx(0.5 * (2 - 1) / (2 * 4 + 2 - 1))
    with pytest.raises(ConfigError, match=f"pipeline_schedule='{looped}' needs virtual_pipeline_size >= 2 \\(got 1\\)"):
        check_schedule(ParallelConfig(pp=2, dp=1, pipeline_schedule=looped, num_microbatches=4))
    tried = {(c.pipeline_schedule, c.virtual_pipeline_size) for c in candidates(ParallelConfig(), 2, 8, layers=4)}
    assert {(looped, 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)} <= tried
    assert not any(schedule == looped and vpp == 1 for schedule, vpp in tried)


def test_the_rows_encode_what_the_schedules_do():
    config = dict(pp=4, dp=1, num_microbatches=8)
    gpipe = ParallelConfig(**config, pipeline_schedule="gpipe")
    one_f_one_b = ParallelConfig(**config, pipeline_schedule="1f1b")
    assert in_flight(gpipe, 0) == 8 and in_flight(one_f_one_b, 0) == 4  # all forwards first; at most pp in 1F1B
    interleaved = ParallelConfig(**config, pipeline_schedule="interleaved-1f1b", virtual_pipeline_size=2)
    zero_bubble = ParallelConfig(**config, pipeline_schedule="zero-bubble", virtual_pipeline_size=2)
    assert bubble_fraction(zero_bubble) == pytest.approx(bubble_fraction(interleaved) / 3)
    with_zero23 = {c.pipeline_schedule for c in candidates(ParallelConfig(), 4, 8, layers=4) if c.zero_stage >= 2}
    assert "zero-bubble" not in with_zero23 and "1f1b" in with_zero23  # its split backward keeps ZeRO-2/3 out
