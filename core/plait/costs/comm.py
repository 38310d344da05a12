"""Communication of one training step, per rank, by group and op: what ``plait.base.comm`` would record.

Tensor parallelism (per micro-step; bench/tp_comm.py checks the same counts against a real step): each
row-parallel linear all-reduces its output forward and the input of its column-parallel region backward;
with SP those become a reduce-scatter + all-gather pair each, the region adds the sequence split at its first
layer and the gather after its final norm, and the norms' weight gradients are all-reduced once per step.
A vocab-parallel embedding all-reduces its output; a vocab-parallel head all-reduces its input's gradient
(without SP) and the cross-entropy three vectors of one float per token.
Activation checkpointing repeats a layer's forward collectives in backward, all but its last row-parallel one.
Pipeline (per micro-step): each micro-batch's hidden states cross every stage boundary forward and their
gradient backward; the loss is broadcast from the last stage; tied embeddings sum their gradient over the
pipeline ends once per step, the modules every stage holds (``every_stage``) over the pipeline. Context
parallelism (group "cp", per micro-step): each rank's tensors above are those of its S/cp tokens, and every
decoder layer's attention moves q, k, v and the output by all-to-all, or k and v (and their gradients) around
the ring (``context_parallel`` has the formulas).
Routed experts under tp (per micro-step): each experts module is a tp region entered and left like a row
linear's column region, and its routing weights enter too (their gradient all-reduced without SP; under SP the
expert indices and weights all-gathered, again when recomputed, and the weights' gradient reduce-scattered).
Experts kept whole over tp (``expert_tensor_parallel=False``) move nothing under SP; without SP each rank takes
its 1/tp share of the rows and the outputs are all-gathered, as are the hidden and routing weights' gradients
backward; their weight gradients are all-reduced over tp once per step like other replicated sums.
Expert parallelism (group "ep", per micro-batch): each MoE layer's dispatch and combine all-to-alls forward and
backward, and the per-expert counts (``experts`` has the formulas).
Data parallel (group "dp", once per step; under cp the replica group of dp x cp ranks, which all hold the
same parameters): gradients all-reduced in 32 MiB buckets, or under ZeRO-1 reduced to their owners and the
updated parameters broadcast one by one. Under ZeRO-2/3 (FSDP2) each unit (a decoder layer, the model's root)
all-gathers its parameters in the compute dtype (bytes: the rank's shard) and reduce-scatters its gradient (fp32
under --bf16) after every backward: stage 3 gathers in every forward and again in every backward, stage 2 once per
step (without pp; under pp once per micro-batch, whose backward frees them). Under ep the expert parameters' go over their own group instead
("edp": the dp x cp / ep ranks holding the same experts).
Bytes are the tensor sizes handed to the collective (as ``count_collectives`` records them); ``ring`` is
what a ring algorithm sends per rank: all-reduce 2(p-1)/p n, all-gather (p-1) n_local, reduce-scatter
(p-1)/p n, reduce and broadcast n (p-1)/p on average, all-to-all (p-1)/p n, send/recv n.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plait.costs.context_parallel import attention_comm
from plait.costs.experts import RoutedCall, ep_comm, token_share
from plait.costs.memory import Precision, RankParam, zero1_owned
from plait.costs.tp_modules import VOCAB_LABELS
from plait.layout_plan import LayoutPlan
from plait.parallel.fsdp import gathered_once, unit_of
from plait.parallel.grad_sync import BUCKET_BYTES
from plait.tp.sequence_parallel import sp_grad_sum_params


@dataclass(frozen=True)
class CommOp:
    group: str  # tp, cp, ep, pp, dp (the replica group, dp x cp ranks), edp (expert replicas, dp x cp / ep)
    op: str
    count: int
    bytes: int

    def ring(self, size: int) -> float:
        """Bytes one rank sends for these collectives over a group of ``size`` ranks (ring algorithms)."""
        if self.op in ("send", "recv"):
            return float(self.bytes if self.op == "send" else 0)
        factor = {"all_reduce": 2 * (size - 1) / size, "all_gather": size - 1, "reduce_scatter": (size - 1) / size,
                  "reduce": (size - 1) / size, "broadcast": (size - 1) / size,
                  "all_to_all": (size - 1) / size}[self.op]
        return factor * self.bytes


@dataclass(frozen=True)
class StepShape:
    """The tensors one micro-step moves: sequences per device (all micro-batches), tokens per sequence (the
    whole sequence: under cp a rank holds seq / cp of them), hidden size."""

    batch: int
    seq: int
    hidden: int
    act_bytes: int  # per activation element
    accumulation: int


def step_comm(
    model: nn.Module, plan: LayoutPlan, pp_rank: int, held: list[RankParam], shape: StepShape,
    precision: Precision, rows: set[str], routed: Sequence[tuple[RoutedCall, bool]] = (),
    whole: frozenset[str] | set[str] = frozenset(),
) -> list[CommOp]:
    """Collectives of one optimizer step on (any tp rank of) pipeline rank ``pp_rank`` holding ``held``;
    ``routed``: the experts calls of its layers (one sequence each, from the trace), and whether each is
    recomputed; ``whole``: experts modules kept whole over tp (``tp_modules.whole_experts``)."""
    config = plan.config
    ops: list[CommOp] = []
    acc = shape.accumulation
    cp = config.cp
    act = shape.batch * shape.seq // cp * shape.hidden * shape.act_bytes  # this rank's tokens
    local = act // config.tp
    split = plan.split
    stages = plan.stages_of(pp_rank)
    has_first = split is None or 0 in stages
    has_last = split is None or split.num_stages - 1 in stages
    if config.tp > 1:
        labels = {shard.style.label for shard in plan.shards_by_rank[0].values()}
        vocab_embedding = bool(labels & set(VOCAB_LABELS[:2]))
        vocab_head = "vocab_head" in labels
        held_modules = {p.name.rpartition(".")[0] for p in held}
        # expert-major experts (Llama 4): a column-row pair over every expert's copy of the tokens, E x the bytes
        major = {n: model.get_submodule(n).num_experts for n, shard in plan.shards_by_rank[0].items()
                 if shard.style.label == "moe_experts_expert_major" and n in held_modules}
        rows = {n for n in rows if n not in major}
        r = sum(1 for n in rows if n in held_modules)  # this rank's row linears
        # scored tokens: the labels are shifted and padded (tp.loss.shift_labels), so every local token is scored,
        # the last one's ignored label included
        tokens = shape.batch * (shape.seq // cp)
        counts: dict[str, list[int]] = {"all_reduce": [0, 0], "all_gather": [0, 0], "reduce_scatter": [0, 0]}

        def add(op: str, n: int, size: int) -> None:
            counts[op][0] += n
            counts[op][1] += n * size

        def expert_major(passes: int, experts: int) -> None:
            """``passes`` of an expert-major region: under SP tokens gathered per expert and partial outputs
            reduce-scattered back, else the output all-reduced; E x a row linear's bytes."""
            if config.sequence_parallel:
                add("all_gather", passes, local * experts)
                add("reduce_scatter", passes, act * experts)
            else:
                add("all_reduce", passes, act * experts)

        if has_first and vocab_embedding:
            add("all_reduce", 1, act)
        if has_last and vocab_head:
            add("all_reduce", 3, tokens * 4)
        tp_experts = {n for n, shard in plan.shards_by_rank[0].items() if shard.style.label == "moe_experts"}
        if config.sequence_parallel:
            # forward's gather, its backward's all-gather after the row output's reduce-scatter, and (not under
            # float8) backward's gather again of the sequence shard the column linears saved (plait.tp.layers);
            # an experts region's gathered input is saved by the experts themselves, so it is not gathered again
            again = 0 if config.float8 else sum(1 for n in rows if n in held_modules and n not in tp_experts)
            add("all_gather", 2 * r + again, local)
            add("reduce_scatter", 2 * r, act)
            if has_first:
                add("all_gather", 1, local)  # backward of the split at the first layer
            if has_last:
                add("all_gather", 1, local)
                add("reduce_scatter", 1, act)
        else:
            add("all_reduce", 2 * r, act)
            if has_last and vocab_head:
                add("all_reduce", 1, act)
        for experts in major.values():
            expert_major(2, experts)  # forward and backward
        for call, recomputed in routed:
            if call.module not in tp_experts:
                continue
            pairs = shape.batch * call.tokens // cp * call.top_k  # the micro-step's (token, expert) pairs
            if config.sequence_parallel:
                add("all_gather", 1 + int(recomputed), pairs * call.index_bytes // config.tp)
                add("all_gather", 1 + int(recomputed), pairs * call.weight_bytes // config.tp)
                add("reduce_scatter", 1, pairs * call.weight_bytes)
            else:
                add("all_reduce", 1, pairs * call.weight_bytes)
        per_mb = config.num_microbatches if split is not None else 1
        for call, _ in routed:
            if call.module in whole and not config.sequence_parallel:  # TokenShareRegion; under SP nothing
                share = per_mb * token_share(shape.batch // per_mb * call.tokens // cp, config.tp, True)
                add("all_gather", 2, share * shape.hidden * shape.act_bytes)  # outputs; hidden's gradient
                add("all_gather", 1, share * call.top_k * call.weight_bytes)  # the routing weights' gradient
        # A recomputed layer repeats its forward collectives in backward, up to the last one whose output backward
        # needs: the final row-parallel output is not recomputed (torch's checkpoint stops early). Experts kept
        # whole save tensors after every row linear, so all of those are recomputed, and nothing after the
        # experts' own last saved tensor (TokenShareRegion's output gather is not).
        for leaf in plan.leaves:
            r_leaf = sum(1 for n in rows if n.startswith(leaf + ".") and n in held_modules)
            # Llama 4's MoE block adds the experts' sum into its shared expert's output in place (out.add_): its
            # layers are recomputed through that last row output too (measured: one more reduce-scatter a layer)
            last = 0 if any(n.startswith(leaf + ".") for n in (*whole, *major)) else 1
            for experts in (e for n, e in major.items() if n.startswith(leaf + ".")):  # before the layer's last row
                expert_major(1, experts)
            if r_leaf and config.sequence_parallel:
                add("all_gather", r_leaf, local)
                add("reduce_scatter", r_leaf - last, act)
            elif r_leaf:
                add("all_reduce", r_leaf - last, act)
        # Under pp every micro-batch runs its own collectives (same bytes in all, m times the count).
        for op, (n, size) in counts.items():
            if n:
                ops.append(CommOp("tp", op, n * per_mb * acc, size * acc))
        # Gradient sums inside tp, once per step, one bucketed all-reduce per group: the SP region's norms over
        # the tp group, and modules whose gradient several tp ranks compute in part (replicated kv heads,
        # per-head norms) over blocks of adjacent ranks.
        summed: dict[object, int] = {}
        learned = [p for p in held if p.trainable]  # gradients exist only for these (LoRA: the adapters)
        if config.sequence_parallel:
            norm_ids = {id(p) for p in sp_grad_sum_params(model, plan.sp_plan, plan.shards_by_rank[0])}
            norms = {n for n, p in model.named_parameters() if id(p) in norm_ids}
            summed["sp"] = sum(p.numel for p in learned if p.name in norms)
        for module, shard in plan.shards_by_rank[0].items():
            if shard.grad_sum_block > 1:  # the shared rows only, where the rest is the rank's own (a fused qkv's q)
                spec = shard.weight
                share = sum(b - a for a, b in spec.local_spans(shard.shared_ranges)) / spec.local_shape[spec.dim] \
                    if shard.shared_ranges else 1
                numel = round(share * sum(p.numel for p in learned if p.name.rpartition(".")[0] == module))
                summed[shard.grad_sum_block] = summed.get(shard.grad_sum_block, 0) + numel
        for numel in summed.values():
            if numel:
                size = numel * precision.grad_bytes
                ops.append(CommOp("tp", "all_reduce", math.ceil(size / BUCKET_BYTES), size))
    if cp > 1:
        compute = max(shape.act_bytes, 4)  # the ring's gradient accumulators: fp32 at least
        layers = [i for s in stages for i in range(*split.bounds[s])] if split is not None else None
        enclosing = {p.name[:i] for p in held for i, c in enumerate(p.name) if c == "."}  # modules holding them
        recomputed = sum(1 for leaf in plan.leaves if leaf in enclosing)
        count = len(layers) if layers is not None else _decoder_layers(model)
        op, n, size = attention_comm(plan, shape.seq, shape.batch, shape.act_bytes, compute, count, recomputed)
        ops.append(CommOp("cp", op, n * acc, size * acc))
    if config.ep > 1:
        count, size = ep_comm(routed, shape.batch, cp, shape.hidden, shape.act_bytes, config.num_microbatches,
                              config.tp, whole, config.ep)
        ops.append(CommOp("ep", "all_to_all", count * acc, size * acc))
    if split is not None:
        m = config.num_microbatches
        mb_act = (local if config.sequence_parallel else act) // m  # SP sends sequence shards between stages
        # Each boundary a stage has sends one tensor per micro-batch one way and receives one the other way.
        boundaries = sum(1 for s in stages if s != split.num_stages - 1) + sum(1 for s in stages if s != 0)
        ops.append(CommOp("pp", "send", boundaries * m * acc, boundaries * m * mb_act * acc))
        ops.append(CommOp("pp", "recv", boundaries * m * acc, boundaries * m * mb_act * acc))
        ops.append(CommOp("pp", "broadcast", acc, 4 * acc))  # the loss
        # grad_sync.sum_copies: first which copies have a gradient (one float each), then the gradients
        if plan.tied and (has_first or has_last):
            tied = [p for p in held if p.trainable and any(p.name in group for group in plan.tied)]
            ops.append(CommOp("pp", "all_reduce", 2, sum(p.numel for p in tied) * precision.grad_bytes + 4 * len(tied)))
        if plan.replicated:  # every stage's copy of the every_stage modules (GradSync.replicated)
            everywhere = [p for p in held if p.trainable and p.name in plan.replicated]
            ops.append(CommOp("pp", "all_reduce", 2,
                              sum(p.numel for p in everywhere) * precision.grad_bytes + 4 * len(everywhere)))
    dp = (config.dp or 1) * cp  # the replica group: every rank holding these parameters
    # The global gradient norm: one float summed over each group whose ranks hold different gradients (under
    # ZeRO-1 the replica group's owned shards cover the experts too, each expert shard owned once; so do FSDP2's rows).
    for group, size in (("tp", config.tp), ("pp", config.pp), ("dp", dp if config.zero_1 or config.fsdp else 1),
                        ("ep", 1 if config.zero_1 or config.fsdp else config.ep)):
        if size > 1:
            ops.append(CommOp(group, "all_reduce", 1, 4))
    apart = config.ep > 1  # expert gradients go over the expert replicas
    trained = [p for p in held if p.trainable]
    groups = [("dp", [p for p in trained if not (apart and p.expert)], dp)]
    if apart:
        groups.append(("edp", [p for p in trained if p.expert], dp // config.ep))
    if config.fsdp and dp > 1:
        return merged(ops + fsdp_comm(plan, held, precision, dp, acc, gathered_once(model, plan.units)))
    for group, params, size in groups:
        if size == 1 or not params:
            continue
        grads = sum(p.numel for p in params) * precision.grad_bytes
        if config.zero_1:
            owners = zero1_owned(params, size, 0.0, True)
            reduces = sum(math.ceil(sum(p.numel for p in o) * precision.grad_bytes / BUCKET_BYTES) for o in owners)
            ops.append(CommOp(group, "reduce", reduces, grads))
            ops.append(CommOp(group, "broadcast", len(params), sum(p.numel for p in params) * _param_bytes(precision)))
        else:
            ops.append(CommOp(group, "all_reduce", math.ceil(grads / BUCKET_BYTES), grads))
    return merged(ops)


def fsdp_comm(plan: LayoutPlan, held: list[RankParam], precision: Precision, replicas: int,
              accumulation: int, once: Collection[str] = ()) -> list[CommOp]:
    """ZeRO-2/3's all-gathers and reduce-scatters over the replica group in one step (``once``: the units stage 3
    gathers once per micro-batch, not twice: ``plait.parallel.fsdp.gathered_once``). Under ep each experts module
    is a unit of its own over the ranks holding the same experts (group "edp", replicas / ep; none where that is
    one rank)."""
    ep = plan.config.ep
    experts = {p.name for p in held if p.expert} if ep > 1 else set()
    ops = _unit_comm(plan, [p for p in held if p.name not in experts], precision, replicas, accumulation, once,
                     "dp", plan.units)
    if experts and replicas // ep > 1:  # the experts modules: those holding the expert parameters
        modules = tuple(sorted({name.rpartition(".")[0] for name in experts}))
        ops += _unit_comm(plan, [p for p in held if p.name in experts], precision, replicas // ep, accumulation, (),
                          "edp", modules)
    return ops


def _unit_comm(plan: LayoutPlan, held: list[RankParam], precision: Precision, replicas: int, accumulation: int,
               once: Collection[str], group: str, unit_names: tuple[str, ...]) -> list[CommOp]:
    """``fsdp_comm`` for the parameters ``held`` of the units ``unit_names`` (the rest: the root unit) over
    ``group`` of ``replicas`` ranks."""
    config = plan.config
    of = {p.name: unit_of(p.name, unit_names) for p in held}
    units = set(of.values())
    itemsize = precision.param.itemsize
    shard = sum(p.numel for p in held) // replicas * itemsize
    backwards = accumulation * config.num_microbatches
    if config.zero_stage == 3:
        kept = units & set(once)
        kept_shard = sum(p.numel for p in held if of[p.name] in kept) // replicas * itemsize
        count, size = backwards * (2 * len(units) - len(kept)), backwards * (2 * shard - kept_shard)
    else:
        rounds = backwards if config.pp > 1 else 1
        count, size = rounds * len(units), rounds * shard
    reduce_bytes = max(itemsize, 4 if precision.param != precision.optimizer else 0)
    trained = sum(p.numel for p in held if p.trainable) * reduce_bytes
    return [CommOp(group, "all_gather", count, size),
            CommOp(group, "reduce_scatter", backwards * len(units), backwards * trained)]


def _decoder_layers(model: nn.Module) -> int:
    text = model.config.get_text_config()
    return text.num_hidden_layers


def merged(ops: list[CommOp]) -> list[CommOp]:
    """One entry per (group, op), counts and bytes summed."""
    totals: dict[tuple[str, str], list[int]] = {}
    for op in ops:
        entry = totals.setdefault((op.group, op.op), [0, 0])
        entry[0] += op.count
        entry[1] += op.bytes
    return [CommOp(group, op, count, size) for (group, op), (count, size) in totals.items()]


def _param_bytes(precision: Precision) -> int:
    return torch.empty((), dtype=precision.param).element_size()
