"""Activation memory of one micro-batch, traced on the meta device.

Rather than a per-architecture formula (Korthikanti et al.'s 34*s*b*h + 5*a*s^2*b holds for Megatron's GPT,
not for a transformers Llama in eager PyTorch), the model itself is run forward, with its loss, on meta
tensors of one sequence, and every tensor autograd saves for backward is recorded
(``torch.autograd.graph.saved_tensors_hooks``): its bytes, the pipeline unit it was saved in (embedding,
decoder layer i, norm/head/loss) and the innermost module saving it. Parameters are not activations;
tensors saved twice (one storage) count once. Meta tensors have shapes and no memory, so this takes about
two seconds for a 70B config at 4096 tokens.

Each saved tensor then scales to a tp rank by what it is: a hidden-sized tensor (last dim = hidden size)
is whole on every tp rank, except inside the sequence-parallel region, where a column-parallel linear saves its
input's sequence shard (1/tp, one for q, k and v) and gathers it again in backward, as Megatron's SP does; one
that does not (float8's kernel, an input entered by its parent module) keeps its own gathered copy; every other
tensor of a decoder layer (heads, MLP intermediate) is split by tp, and logits are split when the LM head is
vocab-parallel. Fused attention (sdpa, flash) keeps no s x s probabilities: those are dropped when tracing
with any kernel other than eager (the meta device runs sdpa's math fallback, which would save them), unless sdpa
runs that math path for real: attention dropout on a device whose fused kernel takes none (torch's CPU kernel).
The same forward counts the bytes its other operations move (``traffic``), for the step time.
Under context parallelism the trace of the whole sequence is divided by cp (``unit_bytes``): every tensor is
per token except eager's probabilities, of which all-to-all keeps 1/cp of the heads and the ring none.
Routed experts (MoE) cannot route on meta: they run a shape-only stand-in that saves what their forward saves
(``experts.ShapeOnlyExperts``), each tensor tagged whole or split by tp, and scaled by the busiest rank's routing
imbalance (``unit_bytes``); each experts call is recorded (tokens, top_k) for FLOPs and communication.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from plait.base.config import ConfigError
from plait.costs.experts import (
    SPLIT, WHOLE, RoutedCall, ShapeOnlyExperts, major_experts, refuse_unmodelled_experts, routed_experts,
)
from plait.costs.meta_forward import forward_on_meta
from plait.costs.traffic import Traffic, TrafficCounter, is_square
from plait.costs.vision import VisionTrace
from plait.pipeline.cuts import fallback_plan
from plait.plugin.declarations import PipelinePlan
from plait.plugin.registry import Registry

FIRST, LAST = "first", "last"


@dataclass(frozen=True)
class Saved:
    """One saved tensor of one sequence: bytes, and how tp divides it."""

    nbytes: int
    hidden: bool  # last dim is the hidden size
    module: str  # the innermost module saving it ("" outside any tracked linear)
    copy: bool = False  # a second linear saving the same input: one tensor here, its own gathered copy under SP
    square: bool = False  # eager attention's s x s probabilities (per head, not per token)
    expert: str = ""  # saved by routed experts: WHOLE on every tp rank, or SPLIT (the intermediate size, 1/tp)
    major: bool = False  # saved by expert-major experts: every token reaches every expert, no routing imbalance


@dataclass
class UnitTrace:
    """What one pipeline unit (``first``, a decoder layer, or ``last``) saves for one sequence."""

    saved: list[Saved] = field(default_factory=list)
    leaf_input: int = 0  # bytes of the hidden states entering it (what a recomputed leaf keeps)
    routed: list[RoutedCall] = field(default_factory=list)  # its experts forwards
    traffic: Traffic = field(default_factory=Traffic)  # its non-matmul operations' bytes (``traffic``)


@dataclass(frozen=True)
class ActivationTrace:
    """Saved tensors of one sequence of ``seq`` tokens, per unit: ``layers[i]`` is decoder layer i."""

    seq: int
    first: UnitTrace
    layers: tuple[UnitTrace, ...]
    last: UnitTrace
    attn_implementation: str
    hidden_bytes: int  # one token's hidden state, what pipeline stages pass on
    logits_bytes: int  # one token's logits (fp32 after the loss's upcast), what the last stage returns
    squares: bool = False  # attention's s x s scores are materialised: eager, or sdpa on torch's math path
    math_attention: bool = False  # sdpa on torch's math path: attention dropout on a device without a fused kernel
    vision: VisionTrace | None = None  # an image-text model's vision tower, per image (``plait.costs.vision``)


def units_of(model: nn.Module, registry: Registry, adapter) -> tuple[PipelinePlan, list[str]]:
    """The adapter's pipeline units (first modules, decoder layers, last modules), also at pp=1."""
    leaf_patterns = registry.leaf_modules(adapter, model.config)
    try:
        plan = registry.pipeline_plan(adapter, model.config)
    except ConfigError:  # the model cannot be cut into stages (XLNet threads a second stream): its units still count
        plan = None
    plan = plan or fallback_plan(model, leaf_patterns)
    layers = [f"{plan.layers}.{name}" for name, _ in model.get_submodule(plan.layers).named_children()]
    return plan, layers


def trace_activations(model: nn.Module, seq: int, registry: Registry, adapter,
                      fused_dropout: bool = True) -> ActivationTrace:
    """Run ``model`` (on the meta device) forward with its loss on one sequence of ``seq`` tokens and record
    what autograd saves, per unit, and which linear or experts module (if any) saved it, and the memory traffic of
    its other operations (``traffic``). ``fused_dropout``: the device's fused attention kernel takes dropout
    (GPUs); torch's CPU kernel does not, and sdpa with attention dropout then runs its math path, which keeps the
    s x s probabilities as eager attention does (``Device.fused_attention_dropout``)."""
    refuse_unmodelled_experts(model)
    plan, layer_names = units_of(model, registry, adapter)
    hidden = getattr(model.config.get_text_config(), "hidden_size", None)
    if hidden is None:  # BLT: byte-level encoder, global transformer and decoder of their own widths
        raise ConfigError(f"plait plan sizes models of one hidden size (config.hidden_size), which "
                          f"{model.config.model_type}'s config does not give; size the run with plait train "
                          f"--max_steps 2")
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    units = {FIRST: UnitTrace(), LAST: UnitTrace(), **{name: UnitTrace() for name in layer_names}}
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    # Storages are told apart by address, which a storage freed with a discarded branch of the graph (DeepSeek's
    # group-limited routing) hands on to a later one: a storage counts as seen while a tensor saved on it lives.
    seen: dict[int, set[str]] = {}  # storage -> the modules ("" outside any) that saved it
    alive: dict[int, list[weakref.ref]] = {}  # storage -> the tensors saved on it
    records: list[tuple[str, Saved, weakref.ref]] = []  # (unit, what, the tensor: held at backward while it lives)
    where = {"unit": FIRST, "stack": []}
    experts = ShapeOnlyExperts(model)
    major = major_experts(model)  # run as written (batched matmuls): whole if over the hidden size, else split
    experts_names = set(routed_experts(model)) | set(major)

    def record(saved: Saved, tensor: torch.Tensor) -> None:
        records.append((where["unit"], saved, weakref.ref(tensor)))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        inner = where["stack"][-1] if where["stack"] else ""
        if key in params:
            return tensor
        if key in seen and all(ref() is None for ref in alive[key]):
            del seen[key], alive[key]
        savers = seen.setdefault(key, set())
        if inner in savers:
            return tensor
        first = not savers
        savers.add(inner)
        alive.setdefault(key, []).append(weakref.ref(tensor))
        nbytes = tensor.untyped_storage().nbytes()
        if not first:  # saved again, by another linear
            if inner and inner not in experts_names:
                record(Saved(nbytes, True, inner, copy=True), tensor)
            return tensor
        if inner in major:
            record(Saved(nbytes, False, inner, expert=WHOLE if tensor.shape[-1] == hidden else SPLIT, major=True),
                   tensor)
            return tensor
        if inner in experts_names:
            record(Saved(nbytes, False, inner, expert=SPLIT if experts.split else WHOLE), tensor)
            return tensor
        square = is_square(tensor, seq) and tensor.is_floating_point()
        record(Saved(nbytes, tensor.dim() > 0 and tensor.shape[-1] == hidden, inner, square=square), tensor)
        return tensor

    handles = []
    for name in layer_names:
        handles.append(model.get_submodule(name).register_forward_pre_hook(_enter_layer(units, where, name),
                                                                           with_kwargs=True))
    for name in plan.last:
        handles.append(model.get_submodule(name).register_forward_pre_hook(lambda *_: where.update(unit=LAST)))
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)):
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: where["stack"].append(n)))
            handles.append(module.register_forward_hook(lambda *_: _pop(where["stack"])))
        elif name in experts_names:
            enter = _enter_major(units, where, name, major[name]) if name in major else \
                _enter_experts(units, where, name)
            handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(module.register_forward_hook(lambda *_: _pop(where["stack"])))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    counter = TrafficCounter(units, where, seq, hidden, params)
    try:
        model.train()  # what training saves (dropout masks included)
        with experts.active(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
            out = forward_on_meta(model, ids)  # held: its graph holds what backward would find
        math = impl == "sdpa" and counter.square_dropout and not fused_dropout
        squares = impl == "eager" or math  # else a fused kernel keeps only its output and logsumexp
        for unit, saved, ref in records:
            if ref() is not None and (squares or not saved.square):
                units[unit].saved.append(saved)
        del out
    finally:
        for handle in handles:
            handle.remove()
    element = next(model.parameters()).element_size()
    vocab = model.get_output_embeddings().weight.shape[0]
    return ActivationTrace(seq, units[FIRST], tuple(units[n] for n in layer_names), units[LAST], impl,
                           hidden * element, vocab * element, squares, math)


def _pop(stack: list) -> None:
    stack.pop()  # a forward hook returning a value would replace the module's output


def _enter_experts(units: dict, where: dict, name: str):
    def hook(module, args, kwargs):
        values = dict(zip(("hidden_states", "top_k_index", "top_k_weights"), args)) | kwargs
        hidden, index, weights = values["hidden_states"], values["top_k_index"], values["top_k_weights"]
        units[where["unit"]].routed.append(RoutedCall(name, hidden.shape[0], index.shape[-1], module.down_proj.shape[0],
                                                      weights.element_size(), index.element_size()))
        where["stack"].append(name)
    return hook


def _enter_major(units: dict, where: dict, name: str, experts: int):
    def hook(module, args, kwargs):
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]  # every token once per expert
        units[where["unit"]].routed.append(RoutedCall(name, rows // experts, experts, experts, 0, 0, major=True))
        where["stack"].append(name)
    return hook


def _enter_layer(units: dict, where: dict, name: str):
    def hook(module, args, kwargs):
        where["unit"] = name
        states = args[0] if args else kwargs.get("hidden_states")
        if isinstance(states, torch.Tensor):
            units[name].leaf_input = states.numel() * states.element_size()
    return hook


def unit_bytes(
    unit: UnitTrace, tp: int, sp: bool, split_others: bool, columns: set[str], cp: int = 1,
    drop_squares: bool = False, imbalance: float = 1.0, whole: frozenset[str] | set[str] = frozenset(),
    saves_shard: frozenset[str] | set[str] = frozenset(),
) -> tuple[int, int]:
    """(bytes saved, largest single tensor) of ``unit`` for one sequence on one tp rank.

    ``sp``: the unit lies in the sequence-parallel region. ``split_others``: its non-hidden tensors are split by
    tp (decoder layers; the head and loss when the LM head is vocab-parallel). ``columns``: column-parallel
    linears, whose (gathered) input is whole on every tp rank under SP too. ``cp``: context-parallel ranks
    sharing the sequence; each holds 1/cp of every tensor (per-token tensors on its S/cp tokens; eager's S x S
    probabilities on all-to-all's 1/cp of the heads). ``drop_squares``: leave out eager's probabilities (the
    ring attention keeps none). ``imbalance``: the factor on routed experts' tensors
    (``experts.effective_imbalance``). ``whole``: experts modules kept whole on every tp rank
    (``tp_modules.whole_experts``), each rank routing only its own 1/tp of the tokens: all their tensors are
    1/tp, none split by tp. ``saves_shard``: column-parallel linears that, under SP, save their input's sequence
    shard and gather it again in backward (``plait.tp.layers``; Megatron's SP): 1/tp of it, once for the linears
    sharing it (q, k, v)."""
    total = largest = 0
    for s in unit.saved:
        if s.square and drop_squares:
            continue
        if s.expert:  # tp's experts region hands every rank all tokens; each holds 1/tp of the intermediate
            shared = s.expert == SPLIT or s.module in whole  # whole experts: the rank's 1/tp of the tokens
            size = math.ceil(_ceil(_ceil(s.nbytes, tp) if shared else s.nbytes, cp) * (1.0 if s.major else imbalance))
            total += size
            largest = max(largest, size)
            continue
        shard = sp and s.module in saves_shard
        if s.copy:  # under SP a linear that gathers for itself keeps its own whole copy; otherwise one is shared
            size = s.nbytes if sp and s.module in columns and not shard else 0
        elif s.hidden:
            size = s.nbytes if (s.module in columns and not shard) or not sp else _ceil(s.nbytes, tp)
        else:
            size = _ceil(s.nbytes, tp) if split_others else s.nbytes
        size = _ceil(size, cp)
        total += size
        largest = max(largest, size)
    return total, largest


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
