"""The sequence-parallel region, derived from the model's layer list: where it begins and ends (the first decoder
layer; the final norm, else the last layer), and the replicated modules with parameters inside it, which must work
token by token (their gradients then summed over tp, like the norms') or be kept whole and run on the whole
sequence, since on a sequence shard anything else would be wrong. What the model hands its layers beside the
hidden states is split with them (``side_inputs``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import defaultdict

from torch import nn

from plait import SPPlan, TPPlan
from plait.base.patterns import matches
from plait.tp.styles import MoEExperts, MoERouter, WholeSequence

from plait_transformers.common import (
    NO_LAYERS, Refusal, holds, is_covered, is_softmax_attention, layer_pattern, own_params, own_params_deep, refuse,
)
from plait_transformers.forward_flow import (
    HIDDEN_ARGUMENTS, STAGE_BUILT, TOKEN_IDS, assigned_names, calls_of, check_no_side_inputs, layer_params,
    source_of, sources, taint_of, users_of,
)
from plait_transformers.layer_linears import token_wise


def sp_plan(model: nn.Module, arch: str, layers: str | None, tp: TPPlan | Refusal) -> SPPlan:
    """From the first decoder layer to the final norm; every replicated module with parameters in between
    must be token-wise (a norm: 1-D parameters only; token by token Linears, ``token_wise``), or its
    work on sequence shards would be wrong, or inside a block kept whole and run on the whole sequence
    (WholeSequence), whose modules' gradients are summed like the norms'."""
    if isinstance(tp, Refusal):
        raise tp
    if layers is None:
        raise refuse(arch, type(model).__name__, NO_LAYERS)
    _check_layers_run_once(model, arch, layers)
    embedding = model.get_input_embeddings()
    outside = [n for n in _beside(model, layers) if own_params_deep(model.get_submodule(n))
               and not holds(model.get_submodule(n), embedding)]
    check_no_side_inputs(model, arch, layers, outside, "each rank's layers would give its gradient for their "
                                                         "sequence shard alone: disable sequence parallelism")
    norm = _final_norm(model, layers)
    end = _region_end(model, arch, layers, norm)
    covered = [r.pattern for r in tp.rules]
    moe_blocks = {r.pattern.rpartition(".")[0] for r in tp.rules if isinstance(r, MoEExperts)}
    experts = {r.pattern.rpartition(".")[2] for r in tp.rules if isinstance(r, MoEExperts)}
    routers = {r.pattern for r in tp.rules if isinstance(r, MoERouter)}
    # kept whole, run on the whole sequence: each rank's gradients cover its output shard, summed as the norms'
    whole = [r.pattern for r in tp.rules if isinstance(r, WholeSequence)]
    norms: list[str] = []
    for name, module in model.get_submodule(layers).named_modules(prefix=layers):
        pattern = layer_pattern(name, layers)
        if not own_params(module) or pattern in norms:
            continue
        if is_covered(name, whole):
            norms.append(pattern)
            continue
        if is_covered(name, [c for c in covered if c not in routers]):
            continue  # sharded, or inside an attention block (its own rules account for it)
        if in_moe_block(model, name, moe_blocks, experts):
            norms.append(pattern)  # router, shared expert: token-wise, on a sequence shard it sees that shard's tokens
            continue
        if any(p.dim() > 1 for p in own_params(module)) and not token_wise(model, layers, name):
            raise refuse(arch, pattern, f"{type(module).__name__} has replicated matrices inside the decoder layers "
                                        f"({_kind(model, layers, name)}); on sequence shards it would be wrong: "
                                        f"disable sequence parallelism")
        norms.append(pattern)
    return SPPlan(begin=f"{layers}.0", end=end, norms=(*norms, end) if end == norm else tuple(norms),
                  side_inputs=side_inputs(model, layers))


def side_inputs(model: nn.Module, layers: str) -> tuple[str, ...]:
    """The arguments the model hands its layers beside the hidden states that read the output of its children with
    parameters (Gemma 4's per-layer inputs, from its per-layer embeddings and projection; Zamba's
    ``original_hidden_states``, a copy of the embeddings), named as the first layer's forward names them: computed
    before the layers on the whole sequence, they must reach each layer as the same sequence shard as the hidden
    states (``SPPlan.side_inputs``; one shaped otherwise is refused when it arrives). Masks and rotary tables, built
    by parameter-free code from the whole sequence (``STAGE_BUILT``), are not among them."""
    parent, _, leaf = layers.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    source = source_of(type(holder).forward)
    if not source:
        return ()
    tree = ast.parse(textwrap.dedent(source))
    called: dict[str, set[str]] = defaultdict(set)  # method or child name -> the children a call of it runs
    for child, module in holder.named_children():
        if child != leaf and own_params_deep(module):
            called[child].add(child)
            for method in users_of(type(holder), child):
                called[method].add(child)
    calls = calls_of(tree, leaf)
    taint, params = taint_of(tree, called, calls), layer_params(model, layers)
    carried = _carried(tree, leaf)
    found: dict[str, None] = {}
    for call in calls:
        named = [(params[i] if i < len(params) else None, a) for i, a in enumerate(call.args)][1:]
        named += [(k.arg, k.value) for k in call.keywords]
        found |= {name: None for name, value in named if name and name not in (*STAGE_BUILT, *HIDDEN_ARGUMENTS)
                  and sources(value, taint, called) - {TOKEN_IDS}}
        threaded = [n for n, value in named if n in found and isinstance(value, ast.Name) and value.id in carried]
        if threaded:
            raise refuse(model.config.model_type, layers, f"the model carries {threaded[0]} from layer to layer "
                                                          f"beside the hidden states (assigned before its loop and in "
                                                          f"it); sequence parallelism splits only values built once "
                                                          f"before the layers: disable sequence parallelism")
    return tuple(found)


def _carried(tree: ast.AST, leaf: str) -> set[str]:
    """Names the model's forward assigns both before its loop over ``self.<leaf>`` and inside it (Inkling2's
    ``block_states``, grown by each block's hidden states): values carried from layer to layer, not built once."""
    loop = next((n for n in ast.walk(tree) if isinstance(n, ast.For) and f"self.{leaf}" in ast.unparse(n.iter)), None)
    if loop is None:
        return set()
    inside = {n for node in loop.body for n in assigned_names(node)}
    before = {n for node in ast.walk(tree) if isinstance(node, ast.stmt) and node.end_lineno < loop.lineno
              for n in assigned_names(node)}
    return inside & before


def _kind(model: nn.Module, layers: str, name: str) -> str:
    """What holds module ``name`` of a decoder layer, for a refusal: softmax attention whose projections no rule reads
    (CTRL's q, k and v on separate inputs; GPT-BigCode's multi-query c_attn), else a mixer of another kind."""
    child = ".".join(name.split(".")[:layers.count(".") + 3])  # layers.<index>.<child>
    block = model.get_submodule(child)
    if is_softmax_attention(block):
        return f"in {type(block).__name__}, attention whose projections no rule splits"
    return "e.g. a state-space or recurrent mixer"


def _beside(model: nn.Module, layers: str) -> list[str]:
    """The modules beside the layer list and beside each module holding it, below the model itself."""
    found, path = [], layers
    while "." in path:
        parent = path.rpartition(".")[0]
        found += [f"{parent}.{n}" for n in model.get_submodule(parent)._modules if f"{parent}.{n}" != path]
        path = parent
    return found


def _check_layers_run_once(model: nn.Module, arch: str, layers: str) -> None:
    """The region is entered at the first layer's input: a model that runs its layers several times per forward
    (HRM's cycles: config.num_hidden_layers counts the runs) would split the sequence again on every run."""
    runs, count = getattr(model.config, "num_hidden_layers", None), len(model.get_submodule(layers))
    if isinstance(runs, int) and runs > count:
        raise refuse(arch, layers, f"the model runs its {count} layers {runs} times in all per forward "
                                   f"(num_hidden_layers={runs}); a sequence-parallel region entered at the first "
                                   f"layer would split the sequence again on each run: disable sequence parallelism")


def _region_end(model: nn.Module, arch: str, layers: str, norm: str | None) -> str:
    """Where the sequence-parallel region ends: at the final norm's output, unless the forward also calls that
    norm before the layers (NanoChat normalises the embeddings with it), where the gather at its output would
    fire on the full-length embeddings too. A parameter-free such norm then runs after the region, which ends
    at the last layer (exact: the norm holds nothing to sum over tp); one with parameters is refused. Without a
    final norm the region ends at the last layer too: what follows runs on the whole sequence, as one process."""
    last = f"{layers}.{len(model.get_submodule(layers)) - 1}"
    if norm is None:
        return last
    parent, _, child = norm.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    try:
        calls = inspect.getsource(type(owner).forward).count(f"self.{child}(")
    except (OSError, TypeError):
        return norm
    if calls <= 1:
        return norm
    if own_params_deep(model.get_submodule(norm)):
        raise refuse(arch, norm, f"{type(owner).__name__}.forward calls the final norm {calls} times (also before the "
                                 f"layers), so the sequence-parallel region cannot end at it: disable sequence "
                                 f"parallelism")
    return last


def in_moe_block(model: nn.Module, name: str, moe_blocks: set[str], experts: set[str]) -> bool:
    """Whether module ``name`` lies inside a real MoE block (one holding an experts child), not merely at a
    path some other layer's MoE block also has (a hybrid model's mixer)."""
    parts = name.split(".")
    for block in moe_blocks:
        depth = block.count(".") + 1
        if len(parts) > depth and matches(block, ".".join(parts[:depth])):
            if experts & set(model.get_submodule(".".join(parts[:depth]))._modules):
                return True
    return False


def _final_norm(model: nn.Module, layers: str) -> str | None:
    """The module the pp plan runs right after the layers (the final norm), else the next one registered whose
    class is a norm, else a norm registered before the layers that the forward calls after its layer loop (OPT's
    ``final_layer_norm``); None for a model without one (post-norm layers: BERT, GPT-1)."""
    plan = list(model.pp_plan or {})
    parent = layers.rpartition(".")[0]
    if layers in plan:
        after = [n for n in plan[plan.index(layers) + 1:] if n.rpartition(".")[0] == parent]
        if after:
            return after[0]
    names = list(model.get_submodule(parent)._modules) if parent else list(model._modules)
    for child in names[names.index(layers.rpartition(".")[2]) + 1:]:
        name = f"{parent}.{child}" if parent else child
        if "norm" in type(model.get_submodule(name)).__name__.lower():
            return name
    return next(iter(norms_after_loop(model, layers)), None)


def norms_after_loop(model: nn.Module, layers: str) -> list[str]:
    """The norms beside the layer list that the forward of the module holding it calls after its loop over the
    layers, in registration order (OPTDecoder registers its ``final_layer_norm`` before its layers)."""
    parent, _, leaf = layers.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    source = inspect.getsource(type(holder).forward)
    loop = source.find(f"self.{leaf}")
    return [f"{parent}.{child}" if parent else child for child, module in holder.named_children()
            if "norm" in type(module).__name__.lower() and source.rfind(f"self.{child}(") > loop >= 0]
