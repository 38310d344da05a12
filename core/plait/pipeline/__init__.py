"""Pipeline parallelism: stages cut by module name from the adapter's plan, run by
``torch.distributed.pipelining`` schedules. ``parallelize`` applies it; ``stage_rows`` shows it."""

from plait.pipeline.layout import (
    plan_stages,
    rank_of_stage,
    replicated_across_stages,
    stage_bytes,
    stage_rows,
    stages_of_rank,
    tied_across_stages,
)

__all__ = [
    "plan_stages", "rank_of_stage", "replicated_across_stages", "stage_bytes", "stage_rows", "stages_of_rank",
    "tied_across_stages",
]
