"""Pipeline parallelism: stages cut by module name from the adapter's plan, run by
``torch.distributed.pipelining`` schedules. ``parallelize`` applies it; ``pipeline_layout`` shows it."""

from plait.pipeline.layout import (
    pipeline_layout,
    plan_stages,
    rank_of_stage,
    stage_bytes,
    stages_of_rank,
    tied_across_stages,
)

__all__ = ["pipeline_layout", "plan_stages", "rank_of_stage", "stage_bytes", "stages_of_rank", "tied_across_stages"]
