"""The pipeline bubble and the micro-batches a pipeline rank holds at once, per schedule.

Bubble (idle fraction of a step), as bench/pp_bubble.py measures it: gpipe and 1f1b (p-1)/(m+p-1);
interleaved 1f1b (p-1)/(v*m+p-1) (Narayanan et al. 2021); zero-bubble (ZB-H1, Qi et al. 2023, which torch's
``ScheduleInterleavedZeroBubble`` implements with v looped stages) fills about two thirds of interleaved
1f1b's bubble with deferred weight-gradient passes: (p-1)/(3*(v*m+p-1)).

In flight, from torch.distributed.pipelining's schedules: 1f1b runs min(m, p-r) forwards on rank r before its
first backward; interleaved schedules (v-1)*p + 2*(p-1-r) chunk forwards of warm-up (capped at v*m) then one
more before the first backward, each chunk holding 1/v of the rank's layers; gpipe all m.
"""

from __future__ import annotations

from plait.base.config import ParallelConfig
from plait.base.pipeline_schedules import SCHEDULES


def bubble_fraction(config: ParallelConfig) -> float:
    """The idle fraction of a training step on a pipeline rank under ``config``'s schedule (0 at pp=1)."""
    p, m, v = config.pp, config.num_microbatches, config.virtual_pipeline_size
    if p == 1:
        return 0.0
    name = config.pipeline_schedule
    if not SCHEDULES[name].multi_stage:
        return (p - 1) / (m + p - 1)
    base = (p - 1) / (v * m + p - 1)
    return base * SCHEDULES[name].bubble_share


def in_flight(config: ParallelConfig, pp_rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak, in units of one micro-batch
    through all of the rank's layers (1 at pp=1: micro-batches run one after another)."""
    p, m, v = config.pp, config.num_microbatches, config.virtual_pipeline_size
    if p == 1:
        return 1.0
    name = config.pipeline_schedule
    if SCHEDULES[name].all_forward_first:
        return float(m)
    if not SCHEDULES[name].multi_stage:
        return float(min(m, p - pp_rank))
    warmup = min(v * m, (v - 1) * p + 2 * (p - 1 - pp_rank))
    return min(v * m, warmup + 1) / v
