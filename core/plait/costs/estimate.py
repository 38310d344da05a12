"""One layout's answer: memory per rank, communication per step, bubble, FLOPs and (with a device) step time.

``estimate_layout`` takes the meta model and its ``LayoutPlan``; the activation trace is shared by every
layout of one search (it depends only on the model, the sequence length and the attention kernel).
Step time = compute / (1 - bubble) + communication, with compute = matmul FLOPs / (peak * efficiency) plus
the bytes the other operations move (``traffic``: norms, activations, dropout, softmax, the loss) and the optimizer's
bytes (AdamW over the parameters the rank
steps: all it holds, or its ZeRO-1 share) / memory bandwidth, and communication = ring bytes / the link's
bandwidth + a latency per collective (tp, cp and pp inside a node when the block of ranks they span fits in
one, dp across nodes when the world does not). plait's collectives are not overlapped with compute, so the
terms add. Under context parallelism each rank computes 1/cp of the tokens (FLOPs and activations 1/cp), its
"dp" collectives span the replica group (dp x cp ranks) and the attention's all-to-alls or ring sends are the
"cp" group's (``context_parallel``). Routed experts count 2 FLOPs per weight element of one expert per
(token, expert) pair, top_k pairs per token under balanced routing, times ``--moe_imbalance`` on the busiest rank
under ep (``experts``); ep's all-to-alls are the "ep" group's and the expert gradients the "edp" group's (dp x cp /
ep ranks), each on the link of the block of ranks its widest group spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from plait.costs.activations import ActivationTrace
from plait.costs.bubble import bubble_fraction
from plait.costs.comm import CommOp, StepShape, step_comm
from plait.costs.device import Device
from plait.costs.experts import check_expert_parallel, effective_imbalance, expert_flops_per_token, expert_parameters
from plait.costs.memory import (ActivationBytes, Precision, StaticBytes, activation_bytes, layers_of, rank_params,
                                static_bytes)
from plait.costs.second_model import SecondModel, second_model_bytes
from plait.costs.tp_modules import column_modules, row_modules, shard_saving_columns, whole_experts
from plait.layout_plan import LayoutPlan
from plait.optim.param_groups import embedding_params
from plait.parallel.grad_sync import BUCKET_BYTES
from plait.plugin.registry import Registry, default_registry


@dataclass(frozen=True)
class Batch:
    """Per data-parallel rank: sequences per micro-step (split into the pipeline's micro-batches), tokens per
    sequence, micro-steps per optimizer step. Under cp every rank of a cp group gets these same sequences and
    holds seq / cp tokens of each. ``rows_per_example``: the sequences one example puts through the model (DPO: a
    pair's chosen and rejected rows, 2), while ``per_device`` counts examples, as the flag does."""

    per_device: int
    seq: int
    accumulation: int = 1
    rows_per_example: int = 1

    @property
    def rows(self) -> int:
        """Sequences per micro-step that go through the model."""
        return self.per_device * self.rows_per_example


@dataclass(frozen=True)
class RankEstimate:
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    static: StaticBytes
    activations: ActivationBytes
    dp_buffer: int  # a flattened gradient bucket during the dp reduction
    cp_rank: int = 0
    second: int = 0  # a training method's frozen second model (reference, teacher): its parameters, kept logits
    grads_in_forward: bool = True  # gradients live while a forward's activations do (see ``peak``)

    @property
    def transient(self) -> int:
        """What lives beside the held bytes at the peak besides the saved activations: a backward's working set,
        or after the last backward (activations freed) the dp reduction's bucket, whichever is larger
        (bench/plan_check.py: adding the bucket to the backward's over-predicted cp2 ring with recomputation by 30%)."""
        a = self.activations
        return max(a.transient, self.dp_buffer - a.in_flight)

    def at_peak(self) -> tuple[str, dict[str, int]]:
        """When this rank's peak falls and what lives then (the values sum to ``peak``). Gradients live beside a
        forward's activations when an earlier micro-step or micro-batch made them (accumulation, pipeline
        schedules) or they are kept for the whole run (fp32 ``main_grad`` beside bf16 parameters): the peak is at
        the forward's end with all of them. Otherwise a step's gradients are born in its backward while its
        activations are freed (plait sets them to None after each step), so the peak is the larger of the
        forward's end (activations, no gradients) and the backward's end (every gradient, the dp bucket, and
        under ZeRO-2 no gathered copies left: ``StaticBytes.released``). Measured on an H200, the allocator's
        peaks at ZeRO-0..3: bench/device_memory.py."""
        s, a = self.static, self.activations
        held = {"parameters": s.parameters, "optimizer": s.optimizer, "gathered": s.gathered,
                "second_model": self.second}
        if self.grads_in_forward:
            return "forward's end", {**held, "gradients": s.gradients, "activations": a.in_flight,
                                     "transient": self.transient}
        forward = {**held, "gradients": 0, "activations": a.in_flight, "transient": a.transient}
        backward = {**held, "gathered": s.gathered - s.released, "gradients": s.gradients, "activations": 0,
                    "transient": max(a.transient, self.dp_buffer)}
        return max(("forward's end", forward), ("backward's end", backward), key=lambda m: sum(m[1].values()))

    @property
    def peak(self) -> int:
        return sum(self.at_peak()[1].values())


@dataclass
class LayoutEstimate:
    """Everything ``plait plan`` prints for one layout."""

    plan: LayoutPlan
    batch: Batch
    precision: Precision
    ranks: list[RankEstimate]
    comm: dict[int, list[CommOp]]  # pp rank -> ops of one step (the same on every tp and dp rank)
    bubble: float
    flops: dict[int, float]  # pp rank -> FLOPs of one step on one of its ranks
    act_bytes_moved: dict[int, dict[str, float]]  # pp rank -> non-matmul bytes of one step, by operation
    attn_implementation: str
    layers: dict[int, int] = field(default_factory=dict)  # pp rank -> decoder layers one of its ranks runs
    step_seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    def for_rank(self, rank: int) -> RankEstimate:
        """The estimate of global rank ``rank`` (rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank)."""
        config = self.plan.config
        tp_rank, cp_rank = rank % config.tp, rank // config.tp % config.cp
        pp_rank, dp_rank = rank // (config.tp * config.cp) % config.pp, rank // (config.tp * config.cp * config.pp)
        if not config.zero_1 and not config.fsdp:  # every replica holds the same bytes: one estimate for all
            dp_rank = cp_rank = 0
        return next(r for r in self.ranks
                    if (r.tp_rank, r.pp_rank, r.dp_rank, r.cp_rank) == (tp_rank, pp_rank, dp_rank, cp_rank))

    def mfu(self, device: Device, seconds: float) -> float:
        """Model FLOPs utilisation: the step's FLOPs without recomputation, per device and second, over the
        device's peak (the mean over pipeline ranks: every device of a pp rank does the same work)."""
        low = self.precision.param != torch.float32 or self.plan.config.bf16_autocast
        useful = 3 / 4 if self.plan.config.gradient_checkpointing else 1.0  # recomputed forwards are not model FLOPs
        mean = sum(self.flops.values()) / len(self.flops)
        return mean * useful / (seconds * device.peak_flops(low))

    def step_time(self, device: Device) -> float:
        """Seconds per optimizer step on ``device`` (the slowest pipeline rank; all wait for it)."""
        config = self.plan.config
        low = self.precision.param != torch.float32 or config.bf16_autocast
        per_node = device.per_node
        tp, cp, pp, dp, ep = config.tp, config.cp, config.pp, config.dp or 1, config.ep
        # Ranks are laid out (dp, pp, cp, tp): a group is inside a node when the block of ranks it spans fits.
        link = lambda span: device.intra_bandwidth if span <= per_node else device.inter_bandwidth  # noqa: E731
        replicas = dp * cp
        ep_groups = [range(g, g + ep) for g in range(0, replicas, ep)]  # plait.base.mesh: consecutive replica ranks
        edp_groups = [range(j, replicas, ep) for j in range(ep)]  # the same experts: one per ep group
        bandwidth = {"tp": link(tp), "cp": link(tp * cp), "pp": link(tp * cp * pp), "dp": link(tp * cp * pp * dp),
                     "ep": link(_span(config, ep_groups)), "edp": link(_span(config, edp_groups))}
        size = {"tp": tp, "cp": cp, "pp": 2, "dp": replicas, "ep": ep, "edp": replicas // ep}
        # Fused AdamW reads parameter, gradient and both moments and writes parameter and moments (masters: plus
        # the low-precision copy written back): bytes per stepped element. torch's multi-tensor AdamW (no fused
        # kernel) runs a kernel per operation: lerp, mul, addcmul, sqrt, div, add, addcdiv, the decay's mul, each
        # reading and writing whole tensors, 18 optimizer-dtype elements per element in all.
        opt, param = self.precision.optimizer.itemsize, self.precision.param.itemsize
        moments = 6 * opt if device.fused_adamw else 18 * opt
        adam = moments + self.precision.grad_bytes + (opt + param if self.precision.masters else 0)
        microbatches = config.num_microbatches * self.batch.accumulation
        recompute = 4 / 3 if config.gradient_checkpointing else 1.0  # one more forward of three passes
        worst = 0.0
        for pp_rank, ops in self.comm.items():
            stepped = max(r.static.stepped for r in self.ranks if r.pp_rank == pp_rank)
            compute = (self.flops[pp_rank] / device.flops(low) + stepped * adam / device.memory_bandwidth
                       + sum(nbytes / device.bandwidth(op) for op, nbytes in self.act_bytes_moved[pp_rank].items())
                       + microbatches * self.layers.get(pp_rank, 0) * device.microbatch_overhead * recompute)
            comm = sum(op.ring(size[op.group]) / (bandwidth[op.group] * device.speed(op.op)) + op.count * device.latency
                       for op in ops)
            # ZeRO-2/3: FSDP2 copies each gathered unit out of the all-gather's buffer and each unit's gradient into
            # the reduce-scatter's (a read and a write of every byte)
            compute += sum(2 * op.bytes * (size["dp"] if op.op == "all_gather" else 1) for op in ops
                           if op.group == "dp" and op.op in ("all_gather", "reduce_scatter")) / device.memory_bandwidth
            worst = max(worst, compute / (1 - self.bubble) + comm)
        return worst


def estimate_layout(
    model: nn.Module, plan: LayoutPlan, batch: Batch, precision: Precision, trace: ActivationTrace,
    weight_decay: float = 0.0, decay_embeddings: bool = True, cache: dict | None = None, moe_imbalance: float = 1.0,
    second: SecondModel | None = None, registry: Registry | None = None,
) -> LayoutEstimate:
    """Memory, communication, bubble and FLOPs of ``plan`` for ``batch`` (``trace``: ``trace_activations`` of
    the same model at ``batch.seq``). ``cache``: a dict kept across the layouts of one search, holding what
    depends only on the model and the plan's sharding and split (each rank's parameters, row/column linears).
    ``moe_imbalance``: the busiest ep rank's routed pairs over its balanced share (``experts``). ``second``: the
    training method's frozen second model, laid out alike (``second_model``; ``registry`` plans it)."""
    cache = {} if cache is None else cache
    config = plan.config
    check_expert_parallel(model, config.ep)
    imbalance = effective_imbalance(moe_imbalance, config.ep)
    tp, pp, dp, cp = config.tp, config.pp, config.dp or 1, config.cp
    microbatch = batch.rows // config.num_microbatches
    act_dtype = torch.bfloat16 if config.bf16_autocast else precision.param
    hidden = model.config.get_text_config().hidden_size
    shape = StepShape(batch.rows, batch.seq, hidden, torch.empty((), dtype=act_dtype).element_size(),
                      batch.accumulation)
    if "named" not in cache:
        cache["named"] = list(model.named_parameters(remove_duplicate=False))
        cache["embeddings"] = embedding_params(model)
        cache["experts"] = expert_parameters(model)
    shards_key = id(plan.shards_by_rank)
    if ("linears", shards_key) not in cache:
        columns = column_modules(model, plan)
        cache["linears", shards_key] = (row_modules(model, plan), columns, whole_experts(plan),
                                        shard_saving_columns(plan, columns))
    rows, columns, whole, saves_shard = cache["linears", shards_key]
    replicas = dp * cp  # ranks holding the same parameters: gradients summed and ZeRO-1 sharded over them
    # gradients beside a forward: from an earlier micro-step or micro-batch, or fp32 main_grads kept for the run
    grads_in_forward = batch.accumulation > 1 or pp > 1 or (precision.masters and not config.fsdp)
    ranks, comm, flops, moved, layer_count = [], {}, {}, {}, {}
    for pp_rank in range(pp):
        acts = activation_bytes(trace, plan, pp_rank, microbatch, columns, imbalance, whole, saves_shard)
        layers = layers_of(plan, pp_rank, len(trace.layers))
        layer_count[pp_rank] = len(layers)
        routed = [(call, any(call.module.startswith(leaf + ".") for leaf in plan.leaves))
                  for i in layers for call in trace.layers[i].routed]
        for tp_rank in range(tp):
            key = ("held", id(plan.specs_by_rank), id(plan.split), config.ep, tp_rank, pp_rank)
            if key not in cache:
                cache[key] = rank_params(model, plan, tp_rank, pp_rank, cache["embeddings"], cache["named"],
                                         cache["experts"])
            held = cache[key]
            if tp_rank == 0:
                comm[pp_rank] = step_comm(model, plan, pp_rank, held, shape, precision, rows, routed, whole)
                flops[pp_rank] = _step_flops(model, plan, pp_rank, held, batch, trace, imbalance, whole)
                moved[pp_rank] = {op: nbytes * config.num_microbatches * batch.accumulation
                                  for op, nbytes in acts.traffic.items()}
            grads = sum(p.numel for p in held if p.trainable) * precision.grad_bytes
            frozen = 0 if second is None else second_model_bytes(second, plan, registry or default_registry(), tp_rank,
                                                                 pp_rank, batch.rows, batch.seq, cache)
            for replica, static in enumerate(static_bytes(held, precision, replicas, config.zero_1, config.ep,
                                                          weight_decay, decay_embeddings, config.zero_stage,
                                                          plan.units)):
                dp_rank, cp_rank = divmod(replica, cp)  # the replica group's order: dp-major, then cp
                rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
                bucket = min(grads, BUCKET_BYTES) if replicas > 1 and not config.fsdp else 0  # FSDP2: in gathered
                ranks.append(RankEstimate(rank, tp_rank, pp_rank, dp_rank, static, acts, bucket, cp_rank, frozen,
                                          grads_in_forward))
    notes = [f"attention: {trace.attn_implementation}"
             + (" (eager keeps the s x s probabilities of every layer)" if trace.attn_implementation == "eager" else
                " (torch's math path: attention dropout, which this device's fused kernel does not take; it keeps "
                "the s x s probabilities of every layer)" if trace.math_attention else
                " (fused: no s x s probabilities kept)")]
    if config.gradient_checkpointing:
        notes.append("activation checkpointing: each decoder layer keeps its input; one layer is recomputed at a time")
    if trace.vision is not None and trace.vision.images:
        notes.append(f"vision tower: {trace.vision.images} image(s) a sample, {trace.vision.saved_bytes:,} B saved and "
                     f"{trace.vision.flops / 1e9:.3g} GFLOP forward per image, whole on every tp rank of the first "
                     f"pipeline stage")
    if config.fsdp and replicas > 1:
        gathered = ("every decoder layer's parameters gathered for the whole step" if config.zero_stage == 2 else
                    "the root unit (embeddings, final norm, head) and two decoder layers gathered at a time")
        notes.append(f"ZeRO-{config.zero_stage} (FSDP2): parameters, gradients and optimizer state sharded over the "
                     f"{replicas} replica ranks, {gathered}")
    if config.zero_1 and replicas > 1:
        notes.append("ZeRO-1: optimizer state and master weights of the parameters each dp rank owns"
                     + (f" (over the dp x cp = {replicas} ranks of a replica group)" if cp > 1 else ""))
    if plan.cp is not None:
        attention = plan.cp.strategy_for(batch.seq)
        notes.append(f"context parallelism: cp={cp}, each rank holds {batch.seq // cp} of {batch.seq} tokens; "
                     f"attention {attention} for {batch.seq}-token sequences (cp_attention {plan.cp.describe()})"
                     + ("; all-to-all's whole-sequence mask counted as a transient"
                        if attention == "all-to-all" and trace.attn_implementation in ("sdpa", "eager") else ""))
    notes += _moe_notes(trace, config, moe_imbalance, imbalance)
    if second is not None:
        notes.append(f"{second.role}: a frozen copy laid out alike, forward-only; its parameters"
                     + (" and its logits of a micro-step (last stage)" if second.keeps_logits else "")
                     + " in each rank's 'second model'")
    return LayoutEstimate(plan, batch, precision, ranks, comm, bubble_fraction(config), flops, moved,
                          trace.attn_implementation, layer_count, notes=notes)


def _moe_notes(trace: ActivationTrace, config, moe_imbalance: float, imbalance: float) -> list[str]:
    """The routing assumption (one line) and the ep layout, for a model with routed experts."""
    calls = [call for unit in trace.layers for call in unit.routed]
    experts = sorted({call.num_experts for call in calls if not call.major})
    if not calls:
        return []
    notes = []
    if experts:
        count = "/".join(map(str, experts))
        skew = f"x{imbalance:g} on the busiest rank (--moe_imbalance {moe_imbalance:g}" + (
            ", capped at ep)" if imbalance < moe_imbalance and config.ep > 1 else
            "; none at ep=1, where a rank computes all its own pairs)" if config.ep == 1 and moe_imbalance != 1 else
            ")")
        notes.append(f"routed experts: balanced routing assumed (each of the {count} experts gets tokens x top_k / "
                     f"experts pairs, so a rank computes tokens x top_k pairs at any ep); expert activations and "
                     f"FLOPs {skew}")
    else:  # expert-major experts only (Llama 4)
        notes.append(f"expert-major experts: every token through each of the {calls[0].num_experts} experts, scaled "
                     f"by its score (no routing to assume: --moe_imbalance has no effect)")
    if config.ep > 1:
        holders = (config.dp or 1) * config.cp // config.ep
        where = (f"their gradients summed{' and ZeRO-1 sharded' if config.zero_1 else ''} over the {holders} ranks "
                 f"holding the same experts (edp)" if holders > 1 else
                 "no other rank holds the same experts: their gradients are not summed, their state not sharded")
        notes.append(f"expert parallelism: ep={config.ep}, each rank holds 1/{config.ep} of every MoE layer's "
                     f"experts; {where}")
    return notes


def _span(config, groups: list[range]) -> int:
    """Ranks spanned by the widest of ``groups`` of replica positions (dp major, then cp) at one (pp, tp) position,
    with ranks laid out (dp, pp, cp, tp)."""
    place = lambda r: (r // config.cp * config.pp * config.cp + r % config.cp) * config.tp  # noqa: E731
    return max(place(g[-1]) - place(g[0]) + config.tp for g in groups)


def _step_flops(model: nn.Module, plan: LayoutPlan, pp_rank: int, held, batch: Batch, trace: ActivationTrace,
                imbalance: float = 1.0, whole: frozenset[str] | set[str] = frozenset()) -> float:
    """Matmul FLOPs of one optimizer step on one rank: 2 per weight element per token forward (embeddings are
    lookups; a tied LM head counts; routed experts per (token, expert) pair, ``experts.expert_flops_per_token``),
    4 * seq * attention width per token per layer for QK^T and AV, backward twice the forward, one more forward
    for recomputed layers; experts modules in ``whole`` are kept whole over tp, computing 1/tp of the tokens."""
    config = plan.config
    text = model.config.get_text_config()
    tokens = batch.rows * batch.seq * batch.accumulation // config.cp  # cp: each rank has 1/cp of them
    vision = trace.vision
    weights = sum(p.numel for p in held if len(p.full_shape) >= 2 and not p.embedding and not p.expert
                  and not (vision is not None and vision.runs_in(p.name)))  # the vision tower runs per image
    has_first = plan.split is None or 0 in plan.stages_of(pp_rank)
    has_last = plan.split is None or plan.split.num_stages - 1 in plan.stages_of(pp_rank)
    if has_last and getattr(text, "tie_word_embeddings", False):
        weights += sum(p.numel for p in held if p.embedding and p.full_shape[0] == text.vocab_size)
    heads = getattr(text, "num_attention_heads", 0)  # none: an attention-free model (Mamba, xLSTM)
    head_dim = (getattr(text, "head_dim", None) or text.hidden_size // heads) if heads else 0
    layers = layers_of(plan, pp_rank, len(trace.layers))
    stacked: dict[str, int] = {}  # experts module -> elements of its stacked weights on this rank
    for p in held:
        if p.expert and len(p.full_shape) == 3:
            module = p.name.rpartition(".")[0]
            stacked[module] = stacked.get(module, 0) + p.numel
    calls = [call for i in layers for call in trace.layers[i].routed]
    per_token = 2 * weights + 4 * batch.seq * heads * head_dim / config.tp * len(layers) + expert_flops_per_token(
        calls, stacked, config.ep, imbalance, trace.seq, config.tp, whole)
    images = 0.0
    if vision is not None and has_first:  # forward and backward of every image of the step's rows, whole per rank
        images = 3 * vision.flops * vision.images * batch.rows * batch.accumulation
    return per_token * tokens * (4 if config.gradient_checkpointing else 3) + images
