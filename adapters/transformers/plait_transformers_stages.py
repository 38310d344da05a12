"""The sequence-parallel region and the pipeline stages, derived from the model's layer list and transformers'
pp plan: where the SP region begins and ends (the replicated modules inside it must work token by token),
and which modules go to the first and last pipeline stage (refused where layers hand each other more than the
hidden states).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

from torch import nn

from plait import PipelinePlan, SPPlan, TPPlan
from plait.patterns import matches
from plait.tp.styles import MoEExperts, MoERouter, WholeSequence

from plait_transformers_common import Refusal, is_covered, get_module, layer_pattern, own_params, own_params_deep, refuse


def sp_plan(model: nn.Module, arch: str, layers: str | None, tp: TPPlan | Refusal) -> SPPlan:
    """From the first decoder layer to the final norm; every replicated module with parameters in between
    must be token-wise (a norm: 1-D parameters only), or its work on sequence shards would be wrong, or inside a
    block kept whole and run on the whole sequence (WholeSequence), whose modules' gradients are summed like
    the norms'."""
    if isinstance(tp, Refusal):
        raise tp
    if layers is None:
        raise refuse(arch, type(model).__name__, "no decoder layer list found (pp plan or _no_split_modules)")
    _check_layers_run_once(model, arch, layers)
    norm = _final_norm(model, arch, layers)
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
        if any(p.dim() > 1 for p in own_params(module)):
            raise refuse(arch, pattern, f"{type(module).__name__} has replicated matrices inside the decoder layers "
                                        f"(e.g. a state-space or recurrent mixer); on sequence shards it would be "
                                        f"wrong: disable sequence parallelism")
        norms.append(pattern)
    return SPPlan(begin=f"{layers}.0", end=end, norms=(*norms, end) if end == norm else tuple(norms))


def _check_layers_run_once(model: nn.Module, arch: str, layers: str) -> None:
    """The region is entered at the first layer's input: a model that runs its layers several times per forward
    (HRM's cycles: config.num_hidden_layers counts the runs) would split the sequence again on every run."""
    runs, count = getattr(model.config, "num_hidden_layers", None), len(model.get_submodule(layers))
    if isinstance(runs, int) and runs > count:
        raise refuse(arch, layers, f"the model runs its {count} layers {runs} times in all per forward "
                                   f"(num_hidden_layers={runs}); a sequence-parallel region entered at the first "
                                   f"layer would split the sequence again on each run: disable sequence parallelism")


def _region_end(model: nn.Module, arch: str, layers: str, norm: str) -> str:
    """Where the sequence-parallel region ends: at the final norm's output, unless the forward also calls that
    norm before the layers (NanoChat normalises the embeddings with it), where the gather at its output would
    fire on the full-length embeddings too. A parameter-free such norm then runs after the region, which ends
    at the last layer (exact: the norm holds nothing to sum over tp); one with parameters is refused."""
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
    return f"{layers}.{len(model.get_submodule(layers)) - 1}"


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


def _final_norm(model: nn.Module, arch: str, layers: str) -> str:
    """The module the pp plan runs right after the layers (the final norm), else the next one registered whose
    class is a norm."""
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
    raise refuse(arch, layers, "no final norm after the decoder layers to end the sequence-parallel region at")


def pipeline_plan(model: nn.Module, arch: str, layers: str | None) -> PipelinePlan:
    """transformers' pp plan in execution order: what runs before the layer list goes to the first stage,
    what runs after it (and the LM head) to the last. Without a pp plan naming the layers, the order is the
    one the forward uses them in (``_execution_order``). Parameter-free modules neither names (rotary tables)
    every stage recomputes; modules with parameters they do not name are a Refusal. Parameterised modules
    before the layers other than the input embedding (learned position embeddings) are neutralised on the
    stages that do not own them."""
    if layers is None:
        raise refuse(arch, type(model).__name__, "no decoder layer list found (pp plan or _no_split_modules)")
    _check_layer_inputs(model, arch, layers)
    plan = model.pp_plan or {}
    parent = layers.rpartition(".")[0]
    siblings = [f"{parent}.{n}" if parent else n for n in model.get_submodule(parent)._modules]
    ordered = [n for n in plan if n in siblings]
    if layers not in ordered:
        ordered = _execution_order(model, arch, layers, siblings)
    if layers not in ordered:
        ordered = siblings
    cut = ordered.index(layers)
    first, last = ordered[:cut], ordered[cut + 1:]
    for name in siblings:
        if name not in ordered:
            if own_params_deep(get_module(model, name)):
                raise refuse(arch, name, "has parameters but transformers' pp plan does not place it on a stage")
            first.append(name)
    outer = [n for n in model._modules if parent and n != parent.split(".")[0]]
    for name in outer:
        if own_params_deep(model.get_submodule(name)) and model.get_submodule(name) is not model.get_output_embeddings():
            raise refuse(arch, name, "has parameters outside the decoder and is not the LM head; plait cannot stage it")
        last.append(name)
    embedding = model.get_input_embeddings()
    neutralize = [n for n in first if own_params_deep(get_module(model, n)) and get_module(model, n) is not embedding]
    return PipelinePlan(first=tuple(first), layers=layers, last=tuple(last), neutralize=tuple(neutralize))


def _execution_order(model: nn.Module, arch: str, layers: str, siblings: list[str]) -> list[str]:
    """``siblings`` (the layer list and the modules beside it) in the order the forward of their parent uses
    them (``self.<child>`` in its source), those it never mentions left out; empty where the source is unreadable
    or does not mention the layers. Registration order is not execution order: OPTDecoder registers its final norm
    and project_out before the layers and runs them after. A module used both before and after the layers
    (NanoChat's final norm, also applied to the embeddings) goes after them: parameter-free, every stage
    recomputes it anyway; with parameters it would be skipped on the first stage, so it is refused."""
    parent = layers.rpartition(".")[0]
    try:
        source = inspect.getsource(type(model.get_submodule(parent) if parent else model).forward)
    except (OSError, TypeError):
        return []
    uses = {n: [m.start() for m in re.finditer(rf"\bself\.{re.escape(n.rpartition('.')[2])}\b", source)]
            for n in siblings}
    if not uses[layers]:
        return []
    start = uses[layers][0]
    for name, found in uses.items():
        if name != layers and found and found[0] < start < found[-1] and own_params_deep(get_module(model, name)):
            raise refuse(arch, name, "the forward uses it both before and after the layers; pipeline stages cannot "
                                     "share its parameters: use pp=1")
    position = {n: start if n == layers else next((p for p in found if p > start), found[0])
                for n, found in uses.items() if found}
    return sorted(position, key=position.__getitem__)


# Decoder-layer inputs every pipeline stage rebuilds itself from the full sequence (docs/decisions.md D2).
STAGE_BUILT = ("attention_mask", "position_embeddings", "position_ids", "cache_position", "past_key_values")


def _layer_call_inputs(source: str, attribute: str) -> dict[str, bool] | None:
    """For the model's loop over ``self.<attribute>``: each keyword the layer call passes -> whether its value
    reads a name the loop body assigns (a value threaded from layer to layer) rather than one the forward builds
    before the loop from its own inputs (Bloom's ALiBi bias, MPT's ``position_bias``), which every pipeline stage
    builds again as it does the mask. None where the loop or the call is not found."""
    tree = ast.parse(textwrap.dedent(source))
    loop = next((n for n in ast.walk(tree) if isinstance(n, ast.For) and f"self.{attribute}" in ast.unparse(n.iter)), None)
    if loop is None:
        return None
    assigned: set[str] = set()
    for node in ast.walk(loop):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
        assigned |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        mutated = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "append", "extend", "insert", "update")
        if mutated and isinstance(node.func.value, ast.Name):  # block_states.append(hidden_states)
            assigned.add(node.func.value.id)
    layer = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    call = next((n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id in layer), None)
    if call is None:
        return None
    return {k.arg: any(isinstance(n, ast.Name) and n.id in assigned for n in ast.walk(k.value))
            for k in call.keywords if k.arg}


def _check_layer_inputs(model: nn.Module, arch: str, layers: str) -> None:
    """Pipeline stages hand on the hidden states alone. A decoder layer that needs another input the model
    threads from layer to layer (Inkling2's ``block_states``, the outputs of earlier blocks) would get, on a
    later stage, a value that never saw the earlier stage's layers: refused, not silently wrong. One the forward
    builds before its loop over the layers (``_layer_call_inputs``) is built again by every stage."""
    parent = layers.rpartition(".")[0]
    source = inspect.getsource(type(model.get_submodule(parent) if parent else model).forward)
    loop = re.search(rf"for (?:\w+, )?(\w+) in (?:enumerate\()?self\.{layers.rpartition('.')[2]}\b", source)
    unpacked = loop and re.search(rf"(\w+(?:\s*,\s*\w+)+)\s*=\s*{loop.group(1)}\(", source)
    if unpacked:  # GlmMoeDsa: hidden_states, topk_indices = decoder_layer(...)
        raise refuse(arch, layers, f"each layer returns {unpacked.group(1).replace(' ', '')}, which the model hands "
                                   f"to the next layer; pipeline stages hand on only the hidden states: use pp=1")
    inputs = _layer_call_inputs(source, layers.rpartition(".")[2])
    for cls in dict.fromkeys(type(layer) for layer in model.get_submodule(layers)):
        params = list(inspect.signature(cls.forward).parameters.values())[2:]  # self, the hidden states
        required = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in STAGE_BUILT
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        threaded = [name for name in required if inputs is None or inputs.get(name, True)]
        if threaded:
            raise refuse(arch, layers, f"{cls.__name__}.forward takes {threaded} besides the hidden states, threaded "
                                       f"from layer to layer by the model; pipeline stages hand on only the hidden "
                                       f"states: use pp=1")
