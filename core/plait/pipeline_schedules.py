"""The pipeline schedules by name: the one table ``ParallelConfig`` validates against, the flags' help lists and
the runner (``plait.pipeline.runner``) builds from.

It imports nothing of plait: the config at the bottom of the stack reads it, so it cannot live in the
``plait.pipeline`` package, whose modules are built on the config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule by name: its ``torch.distributed.pipelining`` class (imported on first use: the
    module costs about a second of start-up, which no pp=1 run should pay) and whether it runs several
    looped stages per rank (``virtual_pipeline_size`` > 1) or exactly one."""

    torch_class: str
    multi_stage: bool


# The one table of schedules: ParallelConfig's choices, the flags' help and the runner all read it.
SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", multi_stage=False),
    "1f1b": Schedule("Schedule1F1B", multi_stage=False),
    "interleaved-1f1b": Schedule("ScheduleInterleaved1F1B", multi_stage=True),
    "zero-bubble": Schedule("ScheduleInterleavedZeroBubble", multi_stage=True),
}
