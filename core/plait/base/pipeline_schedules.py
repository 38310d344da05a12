"""The pipeline schedules by name: the one table ``ParallelConfig`` validates against, the flags' help lists and
the runner (``plait.pipeline.runner``) builds from.

It imports nothing of plait: the config at the bottom of the stack reads it, so it cannot live in the
``plait.pipeline`` package, whose modules are built on the config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule by name, and every fact about it that plait reads: its ``torch.distributed.pipelining``
    class (imported on first use: the module costs about a second of start-up, which no pp=1 run should pay);
    ``min_virtual``/``multi_stage``: the looped stages per rank it runs (``virtual_pipeline_size``: at least
    ``min_virtual``; above 1 only where ``multi_stage``); ``all_forward_first``: every micro-batch's forward before
    any backward (GPipe: all of them in flight at the peak); ``bubble_share``: the share of the interleaved bubble
    left idle (zero-bubble's split backward fills two thirds of it); ``split_backward``: weight gradients computed
    after the input gradients, later than FSDP2 reduces them (ZeRO-2/3 refused)."""

    torch_class: str
    multi_stage: bool
    min_virtual: int = 1
    all_forward_first: bool = False
    bubble_share: float = 1.0
    split_backward: bool = False


# The one table of schedules: ParallelConfig's choices, the flags' help, the runner, the planner's bubble and
# memory, the layout search and the plan's refusals all read it.
SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", multi_stage=False, all_forward_first=True),
    "1f1b": Schedule("Schedule1F1B", multi_stage=False),
    "interleaved-1f1b": Schedule("ScheduleInterleaved1F1B", multi_stage=True, min_virtual=2),
    "zero-bubble": Schedule("ScheduleInterleavedZeroBubble", multi_stage=True, bubble_share=1 / 3,
                            split_backward=True),
}
DEFAULT_SCHEDULE = "1f1b"


def microbatch_refusal(name: str, pp: int, microbatches: int) -> str | None:
    """Why schedule ``name`` cannot run ``microbatches`` microbatches over ``pp`` stages (None: it can): the rule
    the runner enforces (``plait.pipeline.runner.check_schedule``) and the default count is chosen by."""
    if name != "gpipe" and microbatches < pp:
        return (f"pipeline_schedule={name!r} needs num_microbatches >= pp, got num_microbatches={microbatches} < "
                f"pp={pp}; use at least {pp} microbatches or pipeline_schedule='gpipe'")
    rounds = max(1, microbatches // pp)
    if SCHEDULES[name].multi_stage and microbatches % rounds:
        return (f"pipeline_schedule={name!r} runs microbatches in rounds of pp={pp}: num_microbatches={microbatches} "
                f"is not a multiple of its {rounds} rounds; use a multiple of {pp}")
    return None
