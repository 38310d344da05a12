"""Bytes each rank holds: parameters, gradients and optimizer state (exact), activations and the peak.

Parameters, gradients and optimizer state follow the code that allocates them, from the plan's shard specs:
- parameters: the local shape of every parameter of the rank's stages (``ShardSpec.local_shape``, vocab
  padding included); a tied weight is one tensor on its rank, one copy on each of the first and last stage;
- gradients: one per trained parameter (under LoRA the adapters only: the base is frozen), in the parameter dtype; with bf16 parameters and an fp32 optimizer,
  ``optim/mixed_precision.py`` keeps an fp32 ``main_grad`` per parameter for the whole run instead;
- optimizer state: AdamW's ``exp_avg`` and ``exp_avg_sq`` in the optimizer dtype plus a float32 ``step``
  scalar per parameter, and fp32 master copies of bf16 parameters; under ZeRO-1 only for the parameters the
  rank owns, partitioned exactly as ``ZeroRedundancyOptimizer`` does (per parameter group, largest first,
  each to the rank with the fewest elements so far).
Under ZeRO-2/3 (FSDP2, ``plait.parallel.fsdp``) each replica rank stores its rows of every parameter (torch.chunk of dim 0
over the dp x cp ranks), their gradients and AdamW state, all in the optimizer dtype (with --bf16 the shards are the
fp32 masters); the layers compute on gathered copies in the parameter dtype: under stage 2 every unit's for the
whole step, under stage 3 the model's root unit (final norm; tied embeddings) and two units (the one computing and
the one prefetched; counted as the two largest of the decoder layers, the input embedding and the output head). A
unit's gradient is whole, in the parameter dtype and in fp32 for the reduce-scatter, while it is reduced.
Under expert parallelism (ep) a rank holds E/ep of each MoE layer's experts: dim 0 of every experts parameter is
divided by ep, after tp's split of the intermediate dimension. ZeRO-1 then shards the dense parameters over the
replica group (dp x cp ranks) and the expert ones over the expert-replica group (dp x cp / ep ranks, the ranks
holding the same experts), each partitioned as above.
Activations come from ``activations.trace_activations`` and the schedule's in-flight micro-batches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.costs.activations import ActivationTrace, unit_bytes
from plait.costs.bubble import in_flight
from plait.costs.context_parallel import attention_memory, strategy
from plait.costs.experts import expert_parameters
from plait.costs.traffic import add_bytes
from plait.layout_plan import LayoutPlan
from plait.optim.param_groups import decays, embedding_params
from plait.parallel.fsdp import ROOT, row_range, unit_of
from plait.pipeline.cuts import StageSplit

ADAM_STATES = 2  # exp_avg, exp_avg_sq
STEP_BYTES = 4  # AdamW's per-parameter float32 step tensor


@dataclass(frozen=True)
class Precision:
    """Parameter dtype (``--bf16``: bfloat16) and optimizer dtype (``--optimizer_dtype``)."""

    param: torch.dtype = torch.float32
    optimizer: torch.dtype = torch.float32

    @property
    def masters(self) -> bool:
        return self.param != self.optimizer

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element: fp32 ``main_grad`` buffers with master weights, else the parameter's."""
        return _size(self.optimizer if self.masters else self.param)


@dataclass(frozen=True)
class RankParam:
    name: str
    numel: int
    full_shape: tuple[int, ...]
    embedding: bool
    expert: bool = False  # of a routed-experts module: E/ep experts held, state sharded over dp x cp / ep
    trainable: bool = True  # False: a frozen base weight under LoRA (no gradient, no optimizer state)
    rows: int = 1  # dim 0 of the rank's tensor: ZeRO-3 divides these over the replica ranks


def rank_params(
    model: nn.Module, plan: LayoutPlan, tp_rank: int, pp_rank: int, embeddings: set[str] | None = None,
    named: list[tuple[str, nn.Parameter]] | None = None, experts: set[str] | None = None,
) -> list[RankParam]:
    """The parameters tp rank ``tp_rank`` of pipeline rank ``pp_rank`` holds, in the model's order
    (``embeddings``: ``embedding_params(model)``; ``named``: ``named_parameters(remove_duplicate=False)``;
    ``experts``: ``experts.expert_parameters(model)``; all computed here when not given, a search passes them
    once for all layouts). Expert parameters hold E/ep experts (``experts.check_expert_parallel`` first)."""
    specs = plan.specs_by_rank[tp_rank]
    stages = set(plan.stages_of(pp_rank))
    embeddings = embedding_params(model) if embeddings is None else embeddings
    named = list(model.named_parameters(remove_duplicate=False)) if named is None else named
    experts = expert_parameters(model) if experts is None else experts
    ep = plan.config.ep
    tied_spec = {name: names[0] for names in plan.tied for name in names}
    everywhere = set(plan.replicated)  # held by every stage
    held: list[RankParam] = []
    seen: set[int] = set()
    for name, param in named:
        if plan.split is not None and name not in everywhere and _stage_of(plan.split, name) not in stages:
            continue
        key = id(param)
        if key in seen:
            continue
        seen.add(key)
        spec = specs.get(name) or specs.get(tied_spec.get(name, ""))
        shape = spec.local_shape if spec is not None else tuple(param.shape)
        expert = name in experts
        held.append(RankParam(name, math.prod(shape) // (ep if expert else 1), tuple(param.shape), name in embeddings,
                              expert, trainable=plan.lora is None, rows=shape[0] if shape else 1))
    if plan.lora is not None:  # the adapters: built by plait on the real model, not on the meta model planned
        for name, spec in plan.lora.specs(tp_rank).items():
            if plan.split is None or _stage_of(plan.split, name) in stages:
                shape = spec.local_shape
                held.append(RankParam(name, math.prod(shape), tuple(spec.full_shape), False, rows=shape[0]))
    return held


def _stage_of(split: StageSplit, param_name: str) -> int | None:
    """The stage holding ``param_name``; None where no one stage does (``StageSplit.stage_of_param``)."""
    try:
        return split.stage_of_param(param_name)
    except KeyError:
        return None


def zero1_owned(params: list[RankParam], dp: int, weight_decay: float, decay_embeddings: bool) -> list[list[RankParam]]:
    """The parameters each dp rank owns under ZeRO-1: ``ZeroRedundancyOptimizer._partition_parameters`` on
    ``build_optimizer``'s groups (two weight-decay groups when ``weight_decay`` > 0)."""
    if weight_decay:
        groups = [[p for p in params if decays(p.full_shape, p.embedding, decay_embeddings)],
                  [p for p in params if not decays(p.full_shape, p.embedding, decay_embeddings)]]
    else:
        groups = [params]
    owned: list[list[RankParam]] = [[] for _ in range(dp)]
    sizes = [0] * dp
    for group in groups:
        for p in sorted(group, key=lambda q: q.numel, reverse=True):
            rank = sizes.index(min(sizes))
            owned[rank].append(p)
            sizes[rank] += p.numel
    return owned


def optimizer_bytes(params: list[RankParam], precision: Precision) -> int:
    """AdamW state (and master weights) for ``params``."""
    per_element = ADAM_STATES * _size(precision.optimizer) + (_size(precision.optimizer) if precision.masters else 0)
    return sum(p.numel * per_element + STEP_BYTES for p in params)


@dataclass(frozen=True)
class StaticBytes:
    parameters: int
    gradients: int
    optimizer: int
    stepped: int  # parameter elements this rank's optimizer updates (all it holds, or its ZeRO-1 share)
    gathered: int = 0  # ZeRO-2/3: gathered copies of parameters at the peak, and one unit's gradient being reduced
    released: int = 0  # of ``gathered``: what the step's last backward has freed by its end (stage 2's copies)


def fsdp_rows(param: RankParam, replicas: int, rank: int) -> int:
    """Elements of ``param`` replica rank ``rank`` stores under ZeRO-2/3: its torch.chunk of dim 0."""
    start, stop = row_range(param.rows, replicas, rank)
    return param.numel // param.rows * (stop - start)


def fsdp_static_bytes(params: list[RankParam], precision: Precision, replicas: int, stage: int,
                      units: tuple[str, ...], ep: int = 1) -> list[StaticBytes]:
    """Bytes of each replica rank under ZeRO-2/3 (``units``: the leaf modules that are FSDP2 units). Under ep
    expert parameters are sharded over the replicas / ep ranks holding the same experts (their own FSDP2 units:
    ``plait.parallel.fsdp``), replica rank r at position r // ep there."""
    shard, compute = _size(precision.optimizer), _size(precision.param)
    unit_numel: dict[str, int] = {}
    unit_trained: dict[str, int] = {}
    for p in params:
        unit = unit_of(p.name, units)
        unit_numel[unit] = unit_numel.get(unit, 0) + p.numel
        unit_trained[unit] = unit_trained.get(unit, 0) + (p.numel if p.trainable else 0)
    leaves = sorted((n for u, n in unit_numel.items() if u != ROOT), reverse=True)
    if stage == 2:
        gathered = sum(unit_numel.values()) * compute
    else:
        gathered = (unit_numel.get(ROOT, 0) + sum(leaves[:2])) * compute
    reduced = max(unit_trained.values(), default=0) * (compute + (4 if compute != 4 else 0))
    out = []
    for rank in range(replicas):
        rows = [fsdp_rows(p, replicas // ep, rank // ep) if p.expert else fsdp_rows(p, replicas, rank) for p in params]
        stored = sum(rows)
        trained = sum(n for n, p in zip(rows, params) if p.trainable)
        state = trained * ADAM_STATES * shard + STEP_BYTES * sum(1 for p in params if p.trainable)
        out.append(StaticBytes(stored * shard, trained * shard, state, trained, gathered + reduced,
                               gathered if stage == 2 else 0))
    return out


def static_bytes(
    params: list[RankParam], precision: Precision, replicas: int, zero_1: bool, ep: int = 1,
    weight_decay: float = 0.0, decay_embeddings: bool = True, zero_stage: int = 0, units: tuple[str, ...] = (),
) -> list[StaticBytes]:
    """Parameter, gradient and optimizer bytes of the ranks holding ``params`` (a replica group of ``replicas`` =
    dp x cp ranks): one per replica rank under ZeRO-1 (``zero_1``, ``replicas`` > 1), in the group's order, else
    one for all. Under ep the dense parameters are sharded over the group and the expert ones over the ranks
    holding the same experts: replica rank r is position r // ep of its expert-replica group (``plait.base.mesh``).
    ``zero_stage`` 2 or 3: ``fsdp_static_bytes`` (``units``: the plan's FSDP2 units)."""
    if zero_stage >= 2 and replicas > 1:
        return fsdp_static_bytes(params, precision, replicas, zero_stage, units, ep)
    numel = sum(p.numel for p in params)
    params = [p for p in params if p.trainable]  # frozen weights (LoRA's base): no gradient, no optimizer state
    learned = sum(p.numel for p in params)
    statics = functools.partial(StaticBytes, numel * _size(precision.param), learned * precision.grad_bytes)
    if not (zero_1 and replicas > 1):
        return [statics(optimizer_bytes(params, precision), learned)]
    if ep == 1:  # one partition of everything, as without experts
        owned = zero1_owned(params, replicas, weight_decay, decay_embeddings)
    else:
        dense = zero1_owned([p for p in params if not p.expert], replicas, weight_decay, decay_embeddings)
        expert = zero1_owned([p for p in params if p.expert], replicas // ep, weight_decay, decay_embeddings)
        owned = [dense[r] + expert[r // ep] for r in range(replicas)]
    return [statics(optimizer_bytes(o, precision), sum(p.numel for p in o)) for o in owned]


@dataclass(frozen=True)
class ActivationBytes:
    """Activations of one pipeline rank: per micro-batch (all its stages), in flight at the peak, and the
    transient working set of a backward on top."""

    per_microbatch: int
    in_flight_microbatches: float
    in_flight: int
    transient: int
    # bytes its non-matmul operations move per micro-batch (forward, backward, recomputation), by operation
    traffic: dict[str, float] = field(default_factory=dict)


def activation_bytes(
    trace: ActivationTrace, plan: LayoutPlan, pp_rank: int, microbatch: int, columns: set[str],
    imbalance: float = 1.0, whole: frozenset[str] | set[str] = frozenset(),
    saves_shard: frozenset[str] | set[str] = frozenset(),
) -> ActivationBytes:
    """Activation bytes of pipeline rank ``pp_rank`` for micro-batches of ``microbatch`` sequences.

    The trace runs in the parameter dtype (``--bf16_autocast``'s bf16 matmul outputs are not modelled). With
    activation checkpointing a decoder layer keeps only its input, and one layer's activations live again
    while it is recomputed. ``columns``: the plan's column-parallel linears (``tp_modules.column_modules``).
    Under context parallelism every traced tensor is 1/cp (each rank holds S/cp tokens), plus what the
    attention strategy adds (``context_parallel.attention_memory``). ``imbalance``: the factor on routed experts'
    tensors (``experts.effective_imbalance``); ``whole``: experts modules kept whole over tp
    (``tp_modules.whole_experts``); ``saves_shard``: column linears saving their input's sequence shard under SP
    (``tp_modules.shard_saving_columns``)."""
    config = plan.config
    tp, sp, cp = config.tp, config.sequence_parallel, config.cp
    vocab_parallel = tp > 1 and not config.disable_embedding_parallelization
    layers = layers_of(plan, pp_rank, len(trace.layers))
    has_first = plan.split is None or 0 in plan.stages_of(pp_rank)
    has_last = plan.split is None or plan.split.num_stages - 1 in plan.stages_of(pp_rank)
    ring = strategy(plan, trace.seq) == "ring"
    layer_extra = attention_transient = 0
    if cp > 1:
        element = trace.hidden_bytes // plan.model_config.get_text_config().hidden_size
        layer_extra, attention_transient = attention_memory(plan, trace.seq, 1, element, max(element, 4),
                                                            trace.attn_implementation)
    total = largest = recompute = leaf_inputs = 0
    forwards = 2 if config.gradient_checkpointing else 1  # a recomputed layer runs its forward twice
    traffic: dict[str, float] = {}
    for index in layers:
        unit = trace.layers[index]
        add_bytes(traffic, unit.traffic.per_rank(tp, sp, True, cp, trace.squares, forwards))
        saved, big = unit_bytes(unit, tp, sp, True, columns, cp, ring, imbalance, whole, saves_shard)
        saved += layer_extra
        largest = max(largest, big)
        if config.gradient_checkpointing:
            leaf_inputs += _ceil(_ceil(unit.leaf_input, tp) if sp else unit.leaf_input, cp)
            recompute = max(recompute, saved)
        else:
            total += saved
    if has_first:
        total += unit_bytes(trace.first, tp, False, vocab_parallel, columns, cp)[0]
        if trace.vision is not None:  # the vision tower's, whole on every tp rank, per image of a sequence
            total += trace.vision.saved_bytes * trace.vision.images
        add_bytes(traffic, trace.first.traffic.per_rank(tp, False, vocab_parallel, cp))
    if has_last:
        add_bytes(traffic, trace.last.traffic.per_rank(tp, sp, vocab_parallel, cp))
        saved, largest = unit_bytes(trace.last, tp, sp, vocab_parallel, columns, cp, saves_shard=saves_shard)
        total += saved
        # the loss's backward holds the gradient flowing into its log-softmax and the one flowing out, each the
        # size of the saved log-probabilities (bench/gpu_headroom.py: one fp32 [tokens, vocab] under the measured
        # peak with recomputation, where the loss's backward is the peak)
        largest *= 2
    # Backward starts with the gradient of the biggest saved tensor beside everything saved: the loss's
    # log-softmax on the last stage, else a layer's (attention probabilities). With recomputation a layer's
    # saved tensors live again one layer at a time, once the head's and loss's are freed: the transient is
    # whichever is larger. One attention call's working set under cp (its mask, or the ring's blocks) comes on
    # top of its layer's, not of the loss's: a layer's backward runs after the loss's gradient is freed
    # (bench/plan_check.py: adding it to the loss's over-predicted the ring's peak by 10-31%).
    layer = recompute - total if config.gradient_checkpointing else 0
    transient = max(largest, layer + (attention_transient if layers else 0))
    if plan.split is not None:
        # torch.distributed.pipelining keeps each in-flight micro-batch's stage input and output until its
        # backward: hidden states between stages (sequence shards under SP), logits out of the last stage.
        hidden = _ceil(trace.hidden_bytes, tp) if sp else trace.hidden_bytes
        out = _ceil(trace.logits_bytes, tp) if (has_last and vocab_parallel) else trace.logits_bytes
        total += trace.seq // cp * ((out if has_last else hidden) + (0 if has_first else hidden))
    per_mb = (total + leaf_inputs) * microbatch
    flight = in_flight(config, pp_rank)
    transient *= microbatch
    return ActivationBytes(per_mb, flight, int(per_mb * flight), transient,
                           {op: nbytes * microbatch for op, nbytes in traffic.items()})


def layers_of(plan: LayoutPlan, pp_rank: int, num_layers: int) -> list[int]:
    """The decoder layers pipeline rank ``pp_rank`` runs."""
    if plan.split is None:
        return list(range(num_layers))
    return [i for stage in plan.stages_of(pp_rank) for i in range(*plan.split.bounds[stage])]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
