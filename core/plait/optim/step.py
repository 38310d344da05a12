"""Building the optimizer after ``parallelize`` and running one optimizer step in the right order.

The optimizer is built from the ParallelModel, never before it: the parameters are the rank's shards,
and optimizer state (and fp32 masters) is only ever allocated for them (optimum-neuron's lazy optimizer
constructor, here simply a function of the parallel model; ``functools.partial(build_optimizer, ...)``
is the lazy constructor a trainer can hold before the model exists).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from plait.base import comm
from plait.base.config import ConfigError
from plait.base.words import setting
from plait.optim.clip import clip_grads_, global_grad_norm
from plait.optim.expert_zero import ExpertZero1Optimizer
from plait.optim.mixed_precision import MasterWeightOptimizer, accumulate_grads_in
from plait.optim.param_groups import embedding_params, weight_decay_groups
from plait.optim.sharded import ShardedOptimizer
from plait.optim.zero import Zero1Optimizer
from plait.parallel.fsdp import reshard
from plait.parallel.grad_sync import BUCKET_BYTES, GradSync
from plait.parallel_model import ParallelModel


def build_optimizer(
    pmodel: ParallelModel,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    zero_1: bool | None = None,
    optimizer_dtype: torch.dtype | None = None,
    main_grads: bool = True,
    decay_embeddings: bool = True,
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """The optimizer for ``pmodel``'s trainable parameters (any torch optimizer class and its kwargs).

    zero_1: shard optimizer state over the dp group (None: ``pmodel.config.zero_1``); a no-op at dp=1.
    optimizer_dtype: dtype of the optimizer's state and, for parameters of a lower precision (bf16), of fp32
        master weights it steps instead of them (None: the parameters' dtype, no masters).
    main_grads: with master weights, accumulate those parameters' gradients across micro-steps in
        ``optimizer_dtype`` buffers (``param.main_grad``) rather than in their own dtype.
    ``weight_decay`` (in ``optimizer_kwargs``) applies to matrices only, never to biases and norm weights,
        and to embeddings unless ``decay_embeddings=False`` (``optim/param_groups.py``: the same groups for
        every layout).
    Returns a ``torch.optim.Optimizer`` (LR schedulers work on it): ``Zero1Optimizer`` under ZeRO-1
    (``ExpertZero1Optimizer`` with expert parallelism: expert state sharded over the expert-replica group),
    ``ShardedOptimizer`` under ZeRO-2/3 (the local rows of FSDP2's shards; with mixed precision those are fp32
    and are the master weights, so ``optimizer_dtype`` asks for nothing more).
    """
    if not isinstance(pmodel, ParallelModel):
        raise ConfigError(f"build_optimizer takes the ParallelModel that parallelize returns, not a "
                          f"{type(pmodel).__name__}; build the optimizer after parallelize, from the model it returns")
    reshard(pmodel.fsdp)  # ZeRO-2/3: the shards, even where a forward without backward left gathered copies
    params = [p for p in pmodel.parameters() if p.requires_grad]
    zero_1 = pmodel.config.zero_1 if zero_1 is None else zero_1
    if pmodel.fsdp is not None:
        optimizer_dtype = None  # the shards' own dtype: fp32 masters under mixed precision
    low = [p for p in params if optimizer_dtype is not None and p.dtype != optimizer_dtype]
    if low and any(torch.finfo(p.dtype).bits > torch.finfo(optimizer_dtype).bits for p in low):
        dtypes = sorted({str(p.dtype) for p in low})
        raise ConfigError(
            f"optimizer_dtype={optimizer_dtype} is less precise than the parameters ({', '.join(dtypes)}); "
            f"use optimizer_dtype=torch.float32 (master weights) or leave it unset"
        )
    constructor: Any = optimizer_class
    if low:
        constructor = functools.partial(MasterWeightOptimizer, optimizer_class=optimizer_class, dtype=optimizer_dtype)
        if main_grads:
            accumulate_grads_in(low, optimizer_dtype)
    groups: Any = params
    if optimizer_kwargs.get("weight_decay"):
        full_shapes = {name: spec.full_shape for name, spec in pmodel.param_specs.items()}
        groups = weight_decay_groups(pmodel.module.named_parameters(), full_shapes, embedding_params(pmodel.module),
                                     optimizer_kwargs["weight_decay"], decay_embeddings)
    mesh = pmodel.mesh
    if pmodel.fsdp is not None:
        return ShardedOptimizer(groups, optimizer_class, **optimizer_kwargs)
    if zero_1 and pmodel.grad_sync.experts and not comm.trivial(mesh.replica_group):
        groups = groups if isinstance(groups[0], dict) else [{"params": groups}]
        return ExpertZero1Optimizer(groups, pmodel.grad_sync.is_expert, constructor, mesh.replica_group,
                                    mesh.expert_replica_group, **optimizer_kwargs)
    if zero_1 and not comm.trivial(mesh.replica_group):
        return Zero1Optimizer(groups, constructor, mesh.replica_group, **optimizer_kwargs)
    return constructor(groups, **optimizer_kwargs)


# plait's optimizers, which build_optimizer makes from the ParallelModel (the masters one holds fp32 copies)
BUILT_FROM_THE_MODEL = (Zero1Optimizer, ExpertZero1Optimizer, ShardedOptimizer, MasterWeightOptimizer)


def check_holds_model_params(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    """Refuse an optimizer that holds tensors other than the parallel model's trainable parameters: one built on
    the model before ``parallelize`` holds the weights that ``parallelize`` replaced with their shards, and would
    step them without error while the shards never train."""
    if isinstance(optimizer, BUILT_FROM_THE_MODEL):
        return
    ours = {id(p) for p in params}
    held = [t for group in optimizer.param_groups for t in group["params"]]
    foreign = sum(id(t) not in ours and t.requires_grad for t in held)  # frozen ones are never stepped
    if foreign:
        raise ConfigError(f"the optimizer holds {foreign} of its {len(held)} tensors that are not the parallel "
                          f"model's trainable parameters (built before parallelize, which replaces the weights it "
                          f"splits?); build the optimizer after parallelize, from the model it returns: "
                          f"build_optimizer(pmodel, torch.optim.AdamW, ...)")


def check_built_for_zero(optimizer: torch.optim.Optimizer, mesh: Any) -> None:
    """Refuse an optimizer that does not do what the layout's ZeRO stage asks (one not from ``build_optimizer``).
    Under ZeRO-2/3 the gradients arrive reduce-scattered into FSDP2's shards, which only ``ShardedOptimizer``
    steps as such: a plain one had them summed over dp again and normed on this rank's rows alone (the grad norm
    1.3% off at step 1, the losses apart from step 2: an audit). Under ZeRO-1 a plain optimizer holds the whole
    state on every rank, the memory the stage was asked to save."""
    config = mesh.config
    if config.fsdp and not isinstance(optimizer, ShardedOptimizer):
        what = "FSDP2's sharded gradients and parameters, which ShardedOptimizer steps"
    elif config.zero_1 and not comm.trivial(mesh.replica_group) and \
            not isinstance(optimizer, (Zero1Optimizer, ExpertZero1Optimizer)):
        what = "the optimizer state sharded over the data-parallel ranks, which Zero1Optimizer holds"
    else:
        return
    raise ConfigError(f"{setting('zero_stage', config.zero_stage)} asks for {what}, but the optimizer is a plain "
                      f"{type(optimizer).__name__}; build it with build_optimizer(pmodel, torch.optim."
                      f"{type(optimizer).__name__}, ...)")


class NonFiniteStep(RuntimeError):
    """The loss or the global gradient norm of a step is not finite: the step was not applied (gradients are
    dropped, parameters and optimizer state untouched)."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values
        bad = [name for name, value in values.items() if not math.isfinite(value)]
        super().__init__(f"non-finite {' and '.join(bad)} ({', '.join(f'{k}={v}' for k, v in values.items())})")


class UncommittedStep(Exception):
    """A step the replica groups did not commit (a group failed during it): no group applies it."""

    def __init__(self, grad_norm: float) -> None:
        super().__init__(f"step not committed by the replica groups (grad norm {grad_norm:.4g})")
        self.grad_norm = grad_norm


class OptimizerStep:
    """Call once per optimizer step, after the backward of every micro-step; returns the global grad norm.

    In order: sum gradients shared inside the model-parallel group (``grad_sync.model_parallel``), reduce
    over dp (to the owning rank under ZeRO-1, an all-reduce otherwise; either way once per step), compute
    the global norm over the gradients ``grad_sync`` says this rank counts, clip to ``max_grad_norm`` (None:
    no clipping), step, zero the gradients. ``reduce_dtype``: dtype of the dp reduction on the wire (float32
    for bf16 gradients: optimum-neuron's ``higher_cc_precision``); None keeps the gradients' dtype (fp32
    when ``main_grads`` accumulate them).

    Before the step it checks that the global grad norm (and the step's ``loss``, when given) are finite;
    both are the same on every rank, so every rank raises ``NonFiniteStep`` together and none applies it.
    """

    def __init__(
        self, grad_sync: GradSync, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None,
        *, reduce_dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES, across: Any = None,
    ) -> None:
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm={max_grad_norm} must be positive (or None for no clipping)")
        check_holds_model_params(optimizer, grad_sync.params)
        check_built_for_zero(optimizer, grad_sync.mesh)
        self.grad_sync, self.optimizer, self.max_grad_norm = grad_sync, optimizer, max_grad_norm
        self.reduce_dtype, self.bucket_bytes = reduce_dtype, bucket_bytes
        self.across = across  # replica groups beyond this world (plait.run.replicas): average(params), commit()
        self.zero = isinstance(optimizer, (Zero1Optimizer, ExpertZero1Optimizer))
        # ZeRO-2/3: FSDP2 has reduce-scattered the gradients over dp x cp already, each rank holding its rows
        self.sharded = isinstance(optimizer, ShardedOptimizer)
        self.updated = optimizer.owned_params if self.zero else grad_sync.params
        # In the model's order, whatever order ZeRO-1 partitioned the parameters in: the same summation order
        # as without ZeRO, so a one-rank dp group gives the plain run's norm to the last bit.
        updated = {id(p) for p in self.updated}
        self.norm_params = [p for p in grad_sync.norm_params if id(p) in updated]
        # Without ZeRO, expert parameters are summed over the ep group (its ranks hold the other experts); under
        # ZeRO (1, or FSDP2's rows) each expert slice has one owner in the replica group, like every dense parameter.
        owned = self.zero or self.sharded
        self.norm_experts = [] if owned else [p for p in self.norm_params if grad_sync.is_expert(p)]
        self.norm_params = [p for p in self.norm_params if owned or not grad_sync.is_expert(p)]
        mesh = grad_sync.mesh
        self.norm_groups = [mesh.tp_group, mesh.pp_group] + ([mesh.replica_group] if self.zero or self.sharded else [])
        self.device = grad_sync.params[0].device
        # fp32 at least, float64 for a float64 model: the same on every rank, whatever each one owns
        self.norm_dtype = torch.promote_types(torch.float32, grad_sync.params[0].dtype)

    def __call__(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """``loss``: the step's loss, equal on every rank (reduced over dp), checked with the norm."""
        self.grad_sync.model_parallel()
        if self.zero:
            self.optimizer.reduce_gradients(self.bucket_bytes, self.reduce_dtype)
        elif not self.sharded:
            self.grad_sync.data_parallel(self.updated, self.bucket_bytes, self.reduce_dtype)
        if self.across is not None:
            self.across.average(self.updated)
        self.grad_sync.pending.done()  # ZeRO's reductions and FSDP2's own count as the layout's sums
        norm = self.grad_norm()
        checked = {"grad_norm": norm} if loss is None else {"loss": loss.to(norm), "grad_norm": norm}
        if not torch.isfinite(torch.stack(list(checked.values()))).all():  # one host sync, with the norm's
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep({name: value.item() for name, value in checked.items()})
        if self.max_grad_norm is not None:
            clip_grads_(self.updated, self.max_grad_norm, norm)
        if self.across is not None and not self.across.commit():
            self.optimizer.zero_grad(set_to_none=True)
            raise UncommittedStep(norm.item())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the gradients as they are now, reduced (the same on every rank): each
        distinct slice of every parameter counted once over the layout, as one process's ``get_total_norm``."""
        return global_grad_norm(self.norm_params, self.norm_groups, self.device, self.norm_dtype, self.norm_experts,
                                self.grad_sync.mesh.ep_group, self.grad_sync.norm_parts)

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group (what a trainer logs)."""
        return float(self.optimizer.param_groups[0]["lr"])
