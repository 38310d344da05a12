"""ParallelConfig: the layout a user asks for, validated before any process group or weight exists.

Every check here names the numbers involved and the fix, because a wrong layout found at step 1000 (or
as a hang inside a collective) costs far more than one found at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from plait.base.pipeline_schedules import DEFAULT_SCHEDULE, SCHEDULES

CP_ATTENTION = ("auto", "all-to-all", "ring")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearRecipeName values plait runs (plait.parallel.float8)
MOE_AUX_LOSS_SCOPES = ("micro_batch", "global_batch")  # what the router's load-balancing loss averages over


class ConfigError(ValueError):
    """A layout or model/layout combination that plait refuses, with a message naming values and fix."""


def data_parallel_size(world_size: int, tp: int = 1, cp: int = 1, pp: int = 1) -> int:
    """dp = world_size / (tp * cp * pp): the replicas of the model that each take a share of the global batch.

    The one place dp is derived: ``ParallelConfig.resolve`` (so ``plait train``'s mesh and its global batch) and
    ``plait prepare-data``'s global batch call it, so the batch a command reports is the one a run trains on (it
    once left cp out, reporting twice the batch at cp=2). Raises, naming the sizes, when they do not divide."""
    model_parallel = tp * cp * pp
    if world_size < 1:
        raise ConfigError(f"world size {world_size} is not a number of processes; launch a multiple of {model_parallel}")
    if world_size % model_parallel:
        names, values = model_parallel_names(tp, cp, pp)
        raise ConfigError(f"world size {world_size} is not divisible by {names} = {values} = {model_parallel}; "
                          f"launch a multiple of {model_parallel} processes or change {names.replace('*', '/')}")
    return world_size // model_parallel


def model_parallel_names(tp: int, cp: int, pp: int) -> tuple[str, str]:
    """("tp*cp*pp", "2*2*1") as messages write the model-parallel product (cp only where it is used)."""
    return ("tp*cp*pp", f"{tp}*{cp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")


class FaultError(RuntimeError):
    """A fault met while running (a stuck or lost rank, a save the disk refused) that plait has put in one line
    naming the culprit: the command ends with it and exit status 1, not a traceback."""


@dataclass(frozen=True)
class ParallelConfig:
    """How to lay a model out over a torchrun world.

    tp: tensor-parallel size (ranks of one tp group are adjacent: rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i).
    pp: pipeline-parallel size. dp: data-parallel size; None derives it as world_size // (tp * cp * pp).
    cp: context-parallel size: every sequence split over cp ranks from the embedding to the loss (plait.cp);
    cp_attention: how attention sees the whole sequence, "all-to-all" (Ulysses), "ring" or "auto".
    ep: expert-parallel size: each MoE layer's experts divided over ep ranks carved from the dp x cp ranks
    (plait.ep); tokens go to their experts' ranks with an all-to-all. moe_capacity_factor: None is dropless;
    a number caps the (token, expert) pairs a rank sends each expert at ceil(factor * pairs / experts).
    moe_aux_loss_scope: what the MoE router's load-balancing loss (``output_router_logits``) is computed over.
    "micro_batch" (transformers' definition, per forward): each forward's loss, averaged over a step's forwards,
    so its value depends on how the batch is split over dp, cp and microbatches. "global_batch" (Qiu et al. 2025;
    Megatron's global aux loss): one loss from the expert fractions and mean probabilities of every token of
    the step, the same for every layout (plait.parallel.moe_balance; a no-grad routing pass first).
    expert_tensor_parallel: under tp, split each routed expert's intermediate dimension over tp (Megatron's
    expert tensor parallelism); False keeps experts whole on every tp rank, each computing its own tokens (its
    sequence shard under SP, a 1/tp share of the rows without), their gradients summed over tp.
    sp: sequence parallelism inside the tp group (only meaningful when tp > 1).
    disable_embedding_parallelization: keep embeddings and the LM head replicated (optimum-neuron's flag).
    The pipeline and ZeRO fields are read by the pipeline and optimizer stages of ``parallelize``.
    zero_stage: how much of the training state is sharded over the dp x cp ranks (Rajbhandari et al. 2020):
    0 nothing, 1 optimizer state (``zero_1=True`` is the same), 2 also gradients, 3 also parameters. Stages 2
    and 3 run on torch's FSDP2 (``plait.parallel.fsdp``). mixed_precision: under stage 2 or 3, compute in bf16 from
    fp32 parameters: FSDP2 gathers bf16 copies of the fp32 shards (the master weights) and reduces gradients
    in fp32.
    gradient_checkpointing: recompute each leaf module (adapter's ``plait_leaf_modules``) in backward.
    bf16_autocast: run every forward under ``torch.autocast(bfloat16)`` with fp32 parameters (backward follows
    the dtypes autocast chose).
    float8: None, or a torchao float8 training recipe ("tensorwise", "rowwise") for the matmuls of the decoder
    layers' linear layers (plait.parallel.float8; needs torchao, ``pip install 'plait[float8]'``); parameters, gradients
    and optimizer state keep their dtype. float8_emulate: compute those matmuls in emulation (float8-rounded
    operands, fp32 products), on any device: float8's numerics without its speed, for CPUs, tests and GPUs
    without float8 (compute capability < 8.9).
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    cp_attention: str = "auto"
    ep: int = 1
    moe_capacity_factor: float | None = None
    moe_aux_loss_scope: str = "micro_batch"
    expert_tensor_parallel: bool = True
    sp: bool = True
    disable_embedding_parallelization: bool = False
    virtual_pipeline_size: int = 1
    num_microbatches: int = 1
    pipeline_schedule: str = DEFAULT_SCHEDULE
    pipeline_cuts: tuple[str, ...] = field(default_factory=tuple)
    zero_1: bool = False
    zero_stage: int = 0
    mixed_precision: bool = False
    gradient_checkpointing: bool = False
    bf16_autocast: bool = False
    float8: str | None = None
    float8_emulate: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "virtual_pipeline_size", "num_microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError(f"dp={self.dp!r} must be a positive integer or None (derived from the world size)")
        if self.pipeline_schedule not in SCHEDULES:
            raise ConfigError(
                f"pipeline_schedule={self.pipeline_schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}"
            )
        if self.cp_attention not in CP_ATTENTION:
            raise ConfigError(
                f"cp_attention={self.cp_attention!r} is unknown; choose one of {', '.join(CP_ATTENTION)}"
            )
        factor = self.moe_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            raise ConfigError(f"moe_capacity_factor={factor!r} must be a positive number (or None: dropless)")
        if self.moe_aux_loss_scope not in MOE_AUX_LOSS_SCOPES:
            raise ConfigError(f"moe_aux_loss_scope={self.moe_aux_loss_scope!r} is unknown; choose one of "
                              f"{', '.join(MOE_AUX_LOSS_SCOPES)}")
        if self.float8 is not None and self.float8 not in FLOAT8_RECIPES:
            raise ConfigError(
                f"float8={self.float8!r} is unknown; choose one of {', '.join(FLOAT8_RECIPES)} (or None: no float8)"
            )
        if self.float8_emulate and self.float8 is None:
            raise ConfigError(f"float8_emulate=True emulates float8 matmuls, but float8 is off; give float8="
                              f"{' or '.join(map(repr, FLOAT8_RECIPES))}")
        object.__setattr__(self, "pipeline_cuts", tuple(self.pipeline_cuts))
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ConfigError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.zero_1 and self.zero_stage not in (0, 1):
            raise ConfigError(f"zero_1=True is ZeRO stage 1 but zero_stage={self.zero_stage}; give one of them")
        object.__setattr__(self, "zero_stage", 1 if self.zero_1 else self.zero_stage)
        object.__setattr__(self, "zero_1", self.zero_stage == 1)
        if self.mixed_precision and self.zero_stage < 2:
            raise ConfigError(f"mixed_precision=True is FSDP2's bf16 compute, which needs zero_stage 2 or 3 (got "
                              f"{self.zero_stage}); for ZeRO-1 or none, give bf16 parameters (fp32 masters) instead")
        if self.mixed_precision and self.bf16_autocast:
            raise ConfigError("mixed_precision=True and bf16_autocast=True both ask for bf16 compute; give one")

    @property
    def fsdp(self) -> bool:
        """Stages 2 and 3 shard through torch's FSDP2."""
        return self.zero_stage >= 2
    @property
    def sequence_parallel(self) -> bool:
        """SP is on only where it can do something: a tp group of more than one rank."""
        return self.sp and self.tp > 1

    @property
    def sequence_multiple(self) -> int:
        """What a forward's sequence length must be a multiple of: 2 cp under cp (its load-balanced halves), times
        tp under sequence parallelism (each tp rank its shard)."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sequence_parallel else 1)

    @property
    def model_parallel_size(self) -> int:
        """The ranks of one model replica: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def processes(self) -> int:
        """The processes this layout runs on: tp * cp * pp * dp (dp unset: 1, the smallest world)."""
        return self.model_parallel_size * (self.dp or 1)

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with dp filled in, after checking tp * cp * pp * dp == world_size."""
        model_parallel = self.model_parallel_size
        names, values = model_parallel_names(self.tp, self.cp, self.pp)
        derived = data_parallel_size(world_size, self.tp, self.cp, self.pp)
        dp = derived if self.dp is None else self.dp
        if model_parallel * dp != world_size:
            raise ConfigError(
                f"{names}*dp = {values}*{dp} = {model_parallel * dp} != world size {world_size}; "
                f"leave dp unset to derive it, or launch {model_parallel * dp} processes"
            )
        if (dp * self.cp) % self.ep:
            carved = f"dp*cp = {dp}*{self.cp} = {dp * self.cp}" if self.cp > 1 else f"dp = {dp}"
            raise ConfigError(
                f"ep={self.ep} must divide the ranks it is carved from, {carved}; choose an ep that divides "
                f"{dp * self.cp}, or launch more data-parallel ranks"
            )
        return dataclasses.replace(self, dp=dp)

    def describe(self) -> str:
        """One line for logs: the layout as the user would write it (before ``resolve``, dp is what the world size
        will give: ``dp=world/(tp*pp)``, never ``dp=None``)."""
        cp = f" cp={self.cp} ({self.cp_attention})" if self.cp > 1 else ""
        if self.ep > 1:
            cp += f" ep={self.ep}" + (f" capacity={self.moe_capacity_factor:g}" if self.moe_capacity_factor else "")
        if not self.expert_tensor_parallel and self.tp > 1:
            cp += " experts whole over tp"
        if self.moe_aux_loss_scope != "micro_batch":
            cp += f" aux loss over the {self.moe_aux_loss_scope.replace('_', ' ')}"
        if self.float8 is not None:
            cp += f" float8={self.float8}" + (" (emulated)" if self.float8_emulate else "")
        if self.pp > 1:
            cp += f" {self.pipeline_schedule} microbatches={self.num_microbatches}"
        return (
            f"tp={self.tp} pp={self.pp} dp={self.dp or f'world/({model_parallel_names(self.tp, self.cp, self.pp)[0]})'}{cp} sp={self.sequence_parallel} "
            f"vpp={self.virtual_pipeline_size} zero={self.zero_stage}" + (" bf16 (fp32 masters)" if self.mixed_precision else "")
        )
