"""ParallelConfig: the layout a user asks for, validated before any process group or weight exists.

Every check here names the numbers involved and the fix, because a wrong layout found at step 1000 (or
as a hang inside a collective) costs far more than one found at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from plait.pipeline_schedules import SCHEDULES


class ConfigError(ValueError):
    """A layout or model/layout combination that plait refuses, with a message naming values and fix."""


@dataclass(frozen=True)
class ParallelConfig:
    """How to lay a model out over a torchrun world.

    tp: tensor-parallel size (ranks of one tp group are adjacent: rank = (dp_i * pp + pp_i) * tp + tp_i).
    pp: pipeline-parallel size. dp: data-parallel size; None derives it as world_size // (tp * pp).
    sp: sequence parallelism inside the tp group (only meaningful when tp > 1).
    disable_embedding_parallelization: keep embeddings and the LM head replicated (optimum-neuron's flag).
    The pipeline and ZeRO fields are read by the pipeline and optimizer stages of ``parallelize``.
    gradient_checkpointing: recompute each leaf module (adapter's ``plait_leaf_modules``) in backward.
    bf16_autocast: run every forward under ``torch.autocast(bfloat16)`` with fp32 parameters (backward follows
    the dtypes autocast chose).
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    sp: bool = True
    disable_embedding_parallelization: bool = False
    virtual_pipeline_size: int = 1
    num_microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_cuts: tuple[str, ...] = field(default_factory=tuple)
    zero_1: bool = False
    gradient_checkpointing: bool = False
    bf16_autocast: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "virtual_pipeline_size", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError(f"dp={self.dp!r} must be a positive integer or None (derived from the world size)")
        if self.pipeline_schedule not in SCHEDULES:
            raise ConfigError(
                f"pipeline_schedule={self.pipeline_schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}"
            )
        object.__setattr__(self, "pipeline_cuts", tuple(self.pipeline_cuts))

    @property
    def sequence_parallel(self) -> bool:
        """SP is on only where it can do something: a tp group of more than one rank."""
        return self.sp and self.tp > 1

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with dp filled in, after checking tp * pp * dp == world_size."""
        model_parallel = self.tp * self.pp
        if world_size % model_parallel != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp} = {model_parallel}; "
                f"launch a multiple of {model_parallel} processes or change tp/pp"
            )
        dp = world_size // model_parallel if self.dp is None else self.dp
        if self.tp * self.pp * dp != world_size:
            raise ConfigError(
                f"tp*pp*dp = {self.tp}*{self.pp}*{dp} = {self.tp * self.pp * dp} != world size {world_size}; "
                f"leave dp unset to derive it, or launch {self.tp * self.pp * dp} processes"
            )
        return dataclasses.replace(self, dp=dp)

    def describe(self) -> str:
        """One line for logs: the layout as the user would write it."""
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp} sp={self.sequence_parallel} "
            f"vpp={self.virtual_pipeline_size} zero1={self.zero_1}"
        )
