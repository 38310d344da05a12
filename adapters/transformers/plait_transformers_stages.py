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
from collections import defaultdict

from torch import nn

from plait import PipelinePlan, SPPlan, TPPlan
from plait.patterns import matches
from plait.tp.styles import MoEExperts, MoERouter, WholeSequence

from plait_transformers_layer_linears import token_wise
from plait_transformers_common import (
    Refusal, is_covered, get_module, is_softmax_attention, layer_pattern, own_params, own_params_deep, refuse,
)


NO_LAYERS = ("no decoder layer list found (pp plan, _no_split_modules, or a ModuleList of num_hidden_layers blocks "
             "of one class)")


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
               and not _holds(model.get_submodule(n), embedding)]
    _check_no_side_inputs(model, arch, layers, outside, "each rank's layers would give its gradient for their "
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
    source = _source(type(holder).forward)
    if not source:
        return ()
    tree = ast.parse(textwrap.dedent(source))
    called: dict[str, set[str]] = defaultdict(set)  # method or child name -> the children a call of it runs
    for child, module in holder.named_children():
        if child != leaf and own_params_deep(module):
            called[child].add(child)
            for method in _users(type(holder), child):
                called[method].add(child)
    calls = _calls_of(tree, leaf)
    taint, params = _taint(tree, called, calls), _layer_params(model, layers)
    carried = _carried(tree, leaf)
    found: dict[str, None] = {}
    for call in calls:
        named = [(params[i] if i < len(params) else None, a) for i, a in enumerate(call.args)][1:]
        named += [(k.arg, k.value) for k in call.keywords]
        found |= {name: None for name, value in named if name and name not in (*STAGE_BUILT, *HIDDEN_ARGUMENTS)
                  and _sources(value, taint, called) - {TOKEN_IDS}}
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
    inside = {n for node in loop.body for n in _assigned_names(node)}
    before = {n for node in ast.walk(tree) if isinstance(node, ast.stmt) and node.end_lineno < loop.lineno
              for n in _assigned_names(node)}
    return inside & before


def _assigned_names(node: ast.AST) -> set[str]:
    """The names the assignment statements anywhere under ``node`` change (``_assigned`` of each target)."""
    return {name for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in (n.targets if isinstance(n, ast.Assign) else [n.target]) for name in _assigned(target)}


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


def _check_each_layer_runs_once(model: nn.Module, arch: str, layers: str) -> None:
    """A stage runs each of its layers once per micro-batch: a forward that loops over the layer list (or a slice
    of it) inside another loop (Dory's recurrent middle layers, run ``n_recurrent_loops`` times) would be cut into
    stages that run them once, a different model. Loops under ``torch.no_grad()`` are inference paths (xLSTM's
    chunked prefill), not what training runs."""
    parent, _, leaf = layers.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(holder).forward)))
    except (OSError, TypeError):
        return
    inference = {id(node) for block in ast.walk(tree) if isinstance(block, ast.With)
                 and any("no_grad" in ast.unparse(item.context_expr) for item in block.items)
                 for node in ast.walk(block)}
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.For, ast.While)) or id(outer) in inference:
            continue
        for inner in ast.walk(outer):
            if inner is not outer and isinstance(inner, ast.For) and f"self.{leaf}" in ast.unparse(inner.iter):
                raise refuse(arch, layers, f"{type(holder).__name__}.forward runs `{ast.unparse(inner.iter)}` inside "
                                           f"another loop, so some layers run several times per forward; pipeline "
                                           f"stages run each layer once: use pp=1")


def _check_children_called(model: nn.Module, arch: str, path: str) -> None:
    """Stages are cut in the order the forward calls the modules beside ``path``: a module with parameters that the
    forward hands to a function instead of calling (BLT's hash embeddings, passed to ``compute_hash_embeddings``)
    has no place in that order, and a stage without it would fail at its first forward."""
    parent = path.rpartition(".")[0]
    holder = model.get_submodule(parent) if parent else model
    try:
        source = inspect.getsource(type(holder).forward)
    except (OSError, TypeError):
        return
    for child, module in holder.named_children():
        if child == path.rpartition(".")[2]:
            continue  # the layer list (or the module holding it): looped over, zipped, sliced
        used = re.findall(rf"self\.{re.escape(child)}\b(.?)", source)
        if own_params_deep(module) and used and not any(after in "(.[" and after for after in used):
            name = f"{parent}.{child}" if parent else child
            raise refuse(arch, name, f"{type(holder).__name__}.forward hands it to a function instead of calling it, "
                                     f"so plait cannot tell which pipeline stage runs it: use pp=1")


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


def pipeline_plan(model: nn.Module, arch: str, layers: str | None) -> PipelinePlan:
    """transformers' pp plan in execution order: what runs before the layer list goes to the first stage,
    what runs after it (and the LM head) to the last. Without a pp plan naming the layers, the order is the
    one the forward uses them in (``_execution_order``), at each module holding the layer list (BERT-style
    models nest it in an encoder beside the embeddings). Parameter-free modules neither names (rotary tables)
    every stage recomputes; modules with parameters they do not name are a Refusal. Parameterised modules
    before the layers other than the input embedding (learned position embeddings) are neutralised on the
    stages that do not own them; a block holding the input embedding is staged by its children. Those whose
    output goes to the layers beside the hidden states (Gemma's per-layer embeddings), with what they read, every
    stage holds and runs on the token ids instead (``_every_stage``), as it does where the layers read the ids."""
    if layers is None:
        raise refuse(arch, type(model).__name__, NO_LAYERS)
    _check_each_layer_runs_once(model, arch, layers)
    outputs, none, carried = _check_layer_inputs(model, arch, layers)
    _check_no_shared_keys_and_values(model, arch, layers)
    first: list[str] = []
    last: list[str] = []
    unused: list[str] = []
    path = layers
    while True:  # the layer list, then each module holding it, up to the model's child
        _check_children_called(model, arch, path)
        before, after, idle = _around(model, arch, path)
        first, last, unused = before + first, last + after, unused + idle
        if path.count(".") <= 1:
            break
        path = path.rpartition(".")[0]
    if "." in layers:  # the model's own children: the LM head (and ModernBERT's prediction head before it) last
        before, after, idle = _around(model, arch, layers.partition(".")[0])
        for name in before + idle:
            if own_params_deep(model.get_submodule(name)):
                raise refuse(arch, name, "has parameters outside the decoder and runs before it; plait cannot stage it")
        first, last = before + first, last + after
    first = _staged_by_children(model, first)
    embedding = model.get_input_embeddings()
    every, reads_ids = _every_stage(model, layers, first)
    neutralize = [n for n in first if own_params_deep(get_module(model, n)) and get_module(model, n) is not embedding
                  and n not in every]
    first += unused
    _check_no_side_inputs(model, arch, layers, neutralize, "only the first pipeline stage would hold it: use pp=1")
    return PipelinePlan(first=tuple(first), layers=layers, last=tuple(last), neutralize=tuple(neutralize),
                        layer_outputs=outputs, none_outputs=none, every_stage=tuple(every),
                        token_ids=bool(every) or reads_ids, carried=carried)


def _check_no_shared_keys_and_values(model: nn.Module, arch: str, layers: str) -> None:
    """Gemma-3n's and Gemma-4's last ``config.num_kv_shared_layers`` layers attend with the keys and values of an
    earlier layer, handed to them in ``shared_kv_states`` (a mapping every layer gets, which the forward builds
    before its loop): on a later stage than that layer they would find none. Refused where any layer reuses them."""
    config = getattr(model, "config", None)
    shared = getattr(config.get_text_config(), "num_kv_shared_layers", 0) if config is not None else 0
    parent = layers.rpartition(".")[0]
    source = _source(type(model.get_submodule(parent) if parent else model).forward)
    if shared and "shared_kv_states=" in source:
        raise refuse(arch, layers, f"the last {shared} layers attend with the keys and values of earlier layers "
                                   f"(config.num_kv_shared_layers={shared}, in shared_kv_states), which pipeline "
                                   f"stages do not hand on: use pp=1")


def _around(model: nn.Module, arch: str, path: str) -> tuple[list[str], list[str], list[str]]:
    """The siblings of ``path`` (the layer list, or a module holding it) that run before and after it, and those
    with parameters the forward never names but another modality's methods do (Gemma3's vision tower, reached only
    through ``get_image_features``): the first stage holds them, and another stage that called one would fail
    loudly. Any other module with parameters the forward never names is a Refusal."""
    plan = model.pp_plan or {}
    parent = path.rpartition(".")[0]
    siblings = [f"{parent}.{n}" if parent else n for n in model.get_submodule(parent)._modules]
    ordered = [n for n in plan if n in siblings]
    unplanned = [n for n in siblings if n not in ordered and own_params_deep(get_module(model, n))]
    if path not in ordered or unplanned:  # DeepSeek-V4's hc_head, which transformers' pp plan leaves out
        ordered = _execution_order(model, arch, path, siblings)
    if path not in ordered:
        ordered = siblings
    cut = ordered.index(path)
    before, after = ordered[:cut], ordered[cut + 1:]
    unused = [n for n in siblings if n not in ordered and own_params_deep(get_module(model, n))]
    owner = type(model.get_submodule(parent)) if parent else type(model)
    for name in unused:
        if not _modality_only(owner, name.rpartition(".")[2]):
            raise refuse(arch, name, "has parameters but transformers' pp plan does not place it on a stage")
    before += [n for n in siblings if n not in ordered and n not in unused]
    return before, after, unused


def _modality_only(owner: type, child: str) -> bool:
    """Whether the only methods of ``owner`` that use ``self.<child>`` are for another modality's inputs
    (``get_image_features``): never called on text alone."""
    users = [name for name, method in inspect.getmembers(owner, inspect.isfunction)
             if not name.startswith("__") and f"self.{child}" in _source(method)]  # __init__ builds it
    return bool(users) and all(re.search(MODALITY, name) for name in users)


# The names of methods for another modality's inputs (``get_image_features``).
MODALITY = r"image|audio|video|vision|pixel|speech"


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _holds(module: nn.Module, target: nn.Module | None) -> bool:
    return target is not None and any(m is target for m in module.modules())


def _staged_by_children(model: nn.Module, first: list[str]) -> list[str]:
    """``first`` with a block that holds the input embedding among other modules (BERT's embeddings: word and
    position embeddings, a LayerNorm) replaced by its children: later stages run the block's forward on a stand-in
    for the embeddings, so only its parts can be owned by the first stage and neutralised elsewhere."""
    embedding = model.get_input_embeddings()
    out: list[str] = []
    for name in first:
        module = model.get_submodule(name)
        if module is not embedding and _holds(module, embedding):
            out += _staged_by_children(model, [f"{name}.{child}" for child in module._modules])
        else:
            out.append(name)
    return out


def _check_no_side_inputs(model: nn.Module, arch: str, layers: str, modules: list[str], why: str) -> None:
    """A module with parameters before the layers must feed only the hidden states (an added position embedding):
    one whose output the forward hands on beside them to the layers or the block holding them (CPM-Ant's relative
    position bias) would reach later pipeline stages' layers as a stand-in's output, and under SP get from each
    rank's layers the gradient of its sequence shard alone. Refused, saying ``why``."""
    for name in modules:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        inner = layers[len(parent) + 1:].partition(".")[0] if parent else layers.partition(".")[0]
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).forward)))
        except (OSError, TypeError):
            continue
        outputs = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and _calls_self(node.value, child)
                   for t in node.targets if isinstance(t, ast.Name)}
        for call in _calls_of(tree, inner):
            side = [*call.args[1:], *(k.value for k in call.keywords if k.arg not in HIDDEN_ARGUMENTS)]
            used = {a.id for a in side if isinstance(a, ast.Name)} & outputs
            if used:
                raise refuse(arch, name, f"has parameters and its output ({', '.join(sorted(used))}) goes to the "
                                         f"layers beside the hidden states; {why}")


# The keywords a model passes its hidden states to a block under.
HIDDEN_ARGUMENTS = ("hidden_states", "inputs_embeds", "input_embeds", "x")


def _calls_self(node: ast.AST, child: str) -> bool:
    """Whether ``node`` is a call ``self.<child>(...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == child \
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"


def _calls_of(tree: ast.AST, child: str) -> list[ast.Call]:
    """The calls of ``self.<child>`` in ``tree``, and of the loop variable of a loop over it (the layers)."""
    loops = {n.id for loop in ast.walk(tree) if isinstance(loop, ast.For) and f"self.{child}" in ast.unparse(loop.iter)
             for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        _calls_self(n, child) or isinstance(n.func, ast.Name) and n.func.id in loops)]


def _execution_order(model: nn.Module, arch: str, layers: str, siblings: list[str]) -> list[str]:
    """``siblings`` (the layer list and the modules beside it) in the order the forward of their parent uses
    them (``self.<child>`` in its source, or a call of a method using it: Gemma's ``self.get_per_layer_inputs``),
    those it never mentions left out; empty where the source is unreadable
    or does not mention the layers. Registration order is not execution order: OPTDecoder registers its final norm
    and project_out before the layers and runs them after. A module used both before and after the layers
    (NanoChat's final norm, also applied to the embeddings) goes after them: parameter-free, every stage
    recomputes it anyway; with parameters it would be skipped on the first stage, so it is refused."""
    parent = layers.rpartition(".")[0]
    owner = type(model.get_submodule(parent) if parent else model)
    try:
        source = inspect.getsource(owner.forward)
    except (OSError, TypeError):
        return []
    uses = {n: _uses(owner, source, n.rpartition(".")[2]) for n in siblings}
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


def _users(owner: type, child: str) -> list[str]:
    """The methods of ``owner`` other than its forward that use ``self.<child>`` (Gemma's ``get_per_layer_inputs``
    for ``embed_tokens_per_layer``): a call of one in the forward runs the child there. Another modality's
    (``get_image_features``) are left out: text training never runs them (``_modality_only``)."""
    return [name for name, method in inspect.getmembers(owner, inspect.isfunction)
            if not name.startswith("__") and name != "forward" and not re.search(MODALITY, name)
            and re.search(rf"\bself\.{child}\b", _source(method))]


def _uses(owner: type, source: str, child: str) -> list[int]:
    """Where ``source`` (``owner``'s forward) uses ``self.<child>``; where it never names it, where it calls a
    method using it (``_users``)."""
    found = [m.start() for m in re.finditer(rf"\bself\.{child}\b", source)]
    if found:
        return found
    return sorted(m.start() for name in _users(owner, child) for m in re.finditer(rf"\bself\.{name}\(", source))


def _every_stage(model: nn.Module, layers: str, first: list[str]) -> tuple[list[str], bool]:
    """The modules of ``first`` with parameters whose output reaches the layers other than as the hidden states
    (Gemma's per-layer embeddings and projection, CPM-Ant's position bias, handed to the block holding the
    layers), and, for those, the modules whose output they read (Gemma's input embedding, which the projection
    reads). They run before any layer, so on the batch alone: every pipeline stage can compute them as the first
    does, if it holds them (``PipelinePlan.every_stage``). Found at each module holding the layer list
    (``_every_stage_at``). Also whether the layers get the forward's ``input_ids`` (DeepSeek-V4's hash routing,
    Qwen4-Exp's per-layer embeddings): every stage then runs the model on the token ids (``PipelinePlan.token_ids``)."""
    every, reads_ids = _every_stage_at(model, layers, first, _layer_params(model, layers))
    path = layers.rpartition(".")[0]
    while path:  # the blocks holding the layers: their own inputs besides the hidden states
        params = list(inspect.signature(type(model.get_submodule(path)).forward).parameters)[1:]
        every += _every_stage_at(model, path, first, params)[0]  # the ids they get are the model's own input
        path = path.rpartition(".")[0]
    return every, reads_ids


def _every_stage_at(model: nn.Module, path: str, first: list[str], params: list[str]) -> tuple[list[str], bool]:
    """``_every_stage`` in the forward of the parent of ``path`` (the layer list, or a block holding it), whose
    calls of ``path`` (of each layer, for the list) take ``params``: the names followed from the calls of the
    parent's children in ``first`` to those calls (flow-insensitively: a name gets whatever any assignment to it
    reads, which can only add modules); the inputs every stage rebuilds (``STAGE_BUILT``) and the hidden states
    do not count. Also whether those calls read the forward's ``input_ids``."""
    parent = path.rpartition(".")[0]
    owner = type(model.get_submodule(parent) if parent else model)
    source = _source(owner.forward)
    if not source:
        return [], False
    tree = ast.parse(textwrap.dedent(source))
    children = {n.rpartition(".")[2]: n for n in first
                if n.rpartition(".")[0] == parent and own_params_deep(get_module(model, n))}
    called: dict[str, set[str]] = defaultdict(set)  # method or child name -> the children a call of it runs
    for child in children:
        called[child].add(child)
        for method in _users(owner, child):
            called[method].add(child)
    calls = _calls_of(tree, path.rpartition(".")[2])
    taint = _taint(tree, called, calls)
    side = set()
    for call in calls:
        named = [(params[i] if i < len(params) else None, a) for i, a in enumerate(call.args)][1:]
        named += [(k.arg, k.value) for k in call.keywords]
        side |= {c for name, value in named if name not in (*STAGE_BUILT, *HIDDEN_ARGUMENTS)
                 for c in _sources(value, taint, called)}
    reads_ids = TOKEN_IDS in side
    side.discard(TOKEN_IDS)
    every, todo = set(side), list(side)
    while todo:  # what the every-stage modules read, they need too
        child = todo.pop()
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and child in _callees(call, called):
                found = {c for a in (*call.args, *(k.value for k in call.keywords))
                         for c in _sources(a, taint, called)} - every - {TOKEN_IDS}
                every |= found
                todo += found
    return [children[c] for c in children if c in every], reads_ids


def _layer_params(model: nn.Module, layers: str) -> list[str]:
    """The names of the first decoder layer's forward parameters (after ``self``): what positional arguments are."""
    params = list(inspect.signature(type(model.get_submodule(layers)[0]).forward).parameters)
    return params[1:]


def _callees(call: ast.Call, called: dict[str, set[str]]) -> set[str]:
    """The child modules a call runs: ``self.<child>(...)``, ``self.<child>[i](...)`` or ``self.<method>(...)`` of
    a method using them (``called``: method or child name -> child names)."""
    func = call.func.value if isinstance(call.func, ast.Subscript) else call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return called.get(func.attr, set())
    return set()


# The forward argument every stage can be given (``PipelinePlan.token_ids``), a source of its own in ``_sources``.
TOKEN_IDS = "input_ids"

# Reading these off a tensor reads no values; a mask builder (transformers' create_causal_mask) reads only them
# of its inputs_embeds, and every stage rebuilds its masks (``STAGE_BUILT``).
SHAPE_ATTRIBUTES = ("shape", "dtype", "device", "size", "ndim", "dim")


def _sources(node: ast.AST, taint: dict[str, set[str]], called: dict[str, set[str]],
             opaque: frozenset[int] = frozenset()) -> set[str]:
    """The child modules whose output ``node`` reads: the calls in it and the names it reads (``taint``), but
    not through a tensor's shape, dtype or device, a mask builder, or the nodes ``opaque`` names (by id)."""
    if id(node) in opaque or isinstance(node, ast.Attribute) and node.attr in SHAPE_ATTRIBUTES:
        return set()
    if isinstance(node, ast.Name):
        return set(taint.get(node.id, ())) | ({TOKEN_IDS} if node.id == TOKEN_IDS else set())
    if isinstance(node, ast.IfExp) and (given := _ids_given(node.test)) is not None:  # the stages pass input_ids
        return _sources(node.body if given else node.orelse, taint, called, opaque)
    found: set[str] = set()
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if "mask" in name.lower() and not _callees(node, called):
            return set()
        found |= _callees(node, called)
    for child in ast.iter_child_nodes(node):
        found |= _sources(child, taint, called, opaque)
    return found


def _ids_given(test: ast.AST) -> bool | None:
    """For a test ``input_ids is not None`` (``is None``): True (False); None for any other test."""
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == TOKEN_IDS and len(
            test.ops) == 1 and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
        return isinstance(test.ops[0], ast.IsNot) if isinstance(test.ops[0], (ast.Is, ast.IsNot)) else None
    return None


def _assigned(target: ast.AST) -> list[str]:
    """The names an assignment to ``target`` changes: ``x``, each of ``x, y``, and ``x`` of ``x[k]`` or ``x.a``
    (not ``k``)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _assigned(element)]
    if isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
        return _assigned(target.value)
    return []


def _taint(tree: ast.AST, called: dict[str, set[str]], layer_calls: list[ast.Call]) -> dict[str, set[str]]:
    """Each name of the forward -> the child modules whose output it may hold, through any assignment (a loop
    target, ``x.append(y)``, ``x[k] = y``), iterated to a fixed point; not through the layers (``layer_calls``):
    what they hand each other is ``_check_layer_inputs``' to judge."""
    opaque = frozenset(id(call) for call in layer_calls)
    flows: list[tuple[list[str], ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flows.append(([name for t in targets for name in _assigned(t)], node.value))
        elif isinstance(node, ast.For):
            flows.append((_assigned(node.target), node.iter))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                node.func.value, ast.Name) and node.func.attr in ("append", "extend", "insert", "update"):
            flows.append(([node.func.value.id], node))
    taint: dict[str, set[str]] = defaultdict(set)
    changed = True
    while changed:
        changed = False
        for targets, value in flows:
            found = _sources(value, taint, called, opaque)
            for name in targets:
                if not found <= taint[name]:
                    taint[name] |= found
                    changed = True
    return taint


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


def _threaded(source: str, layer: str, outputs: list[str]) -> list[str]:
    """Those of ``outputs`` (what each layer returns besides the hidden states) that go into a call of ``layer``
    (the next layer), rather than only being collected (Bamba's attention weights)."""
    calls = [n for n in ast.walk(ast.parse(textwrap.dedent(source)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == layer]
    used = {n.id for call in calls for n in ast.walk(call) if isinstance(n, ast.Name)}
    return [name for name in outputs if name in used]


def _cache_only(source: str, name: str, layer: str) -> bool:
    """Whether ``name``, threaded from layer to layer, is a cache that stays None without ``use_cache`` (RWKV's
    ``state``): a forward argument defaulting to None, set before the loop only under a test of ``use_cache``,
    and handed to every layer call with ``use_cache``. Pipeline stages run with ``use_cache=False``; that the
    layers then return None for it is checked on every forward (``PipelinePlan.none_outputs``)."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    arguments = function.args.args + function.args.kwonlyargs
    defaults = dict(zip([a.arg for a in function.args.args][::-1], function.args.defaults[::-1]))
    defaults |= {a.arg: d for a, d in zip(function.args.kwonlyargs, function.args.kw_defaults) if d is not None}
    default = defaults.get(name)
    if name not in {a.arg for a in arguments} or not (isinstance(default, ast.Constant) and default.value is None):
        return False
    guarded: set[int] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.If) and "use_cache" in ast.unparse(node.test):
            guarded |= {id(n) for n in ast.walk(node)}
    loops = [n for n in ast.walk(function) if isinstance(n, ast.For)]
    in_loop = {id(n) for loop in loops for n in ast.walk(loop)}
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        writes = any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t))
        if writes and id(node) not in guarded and id(node) not in in_loop:
            return False
    calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == layer]
    return bool(calls) and all(any(k.arg == "use_cache" for k in call.keywords) for call in calls)


def _check_layer_inputs(
    model: nn.Module, arch: str, layers: str,
) -> tuple[int, tuple[int, ...], tuple[tuple[int, str], ...]]:
    """Pipeline stages hand on the hidden states, and what a layer returns that the model hands to the next layer
    by keyword (GLM-MoE-DSA's ``prev_topk_indices=topk_indices``: ``PipelinePlan.carried``). A decoder layer
    that needs another input the model threads from layer to layer (Inkling2's ``block_states``, the outputs of
    earlier blocks) would get, on a later stage, a value that never saw the earlier stage's layers: refused, not
    silently wrong. One the forward builds before its loop over the layers (``_layer_call_inputs``) is built
    again by every stage. Returns how many values each layer returns where the model unpacks them
    (``PipelinePlan.layer_outputs``), else 0, which of them are a cache threaded to the next layer that must be
    None (``PipelinePlan.none_outputs``), and the carried ones with their keywords."""
    parent = layers.rpartition(".")[0]
    source = inspect.getsource(type(model.get_submodule(parent) if parent else model).forward)
    loop = re.search(rf"for (?:\w+, )?(\w+) in (?:enumerate\()?self\.{layers.rpartition('.')[2]}\b", source)
    unpacked = loop and _unpacked(source, loop.group(1))
    outputs, none, carried = 0, (), ()
    if unpacked:
        names = unpacked.replace(" ", "").split(",")
        threaded = _threaded(source, loop.group(1), names[1:])
        caches = [name for name in threaded if _cache_only(source, name, loop.group(1))]
        keywords = _keywords(source, loop.group(1), [name for name in threaded if name not in caches])
        if None in keywords.values():
            raise refuse(arch, layers, f"each layer returns {','.join(names)}, which the model hands to the next "
                                       f"layer other than by keyword; pipeline stages hand on only the hidden states "
                                       f"and keyword values: use pp=1")
        # Bamba's attention weights, only collected, and RWKV's state, None without use_cache: the stand-ins for
        # another stage's layers return as many values (the hidden states, then None), which the model unpacks
        outputs = len(names)
        none = tuple(names.index(name) for name in caches)
        carried = tuple((names.index(name), keyword) for name, keyword in keywords.items())
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
    return outputs, none, carried


def _unpacked(source: str, layer: str) -> str | None:
    """The names the model unpacks a call of ``layer`` into (``hidden_states, attn_weights``), directly or from the
    name it assigns the call to (CPM-Ant's ``layer_outputs = layer(...)``, then ``hidden_states, attn_weights =
    layer_outputs``); None where it takes one value or indexes it."""
    direct = re.search(rf"(\w+(?:\s*,\s*\w+)+)\s*=\s*{layer}\(", source)
    if direct:
        return direct.group(1)
    named = re.search(rf"(\w+)\s*=\s*{layer}\(", source)
    later = named and re.search(rf"(\w+(?:\s*,\s*\w+)+)\s*=\s*{named.group(1)}\s*$", source, re.MULTILINE)
    return later.group(1) if later else None


def _keywords(source: str, layer: str, names: list[str]) -> dict[str, str | None]:
    """For each of ``names`` (values a layer returns and the model hands to the next layer): the keyword the
    calls of ``layer`` pass it under (``prev_topk_indices=topk_indices``), or None where one passes it otherwise."""
    calls = [n for n in ast.walk(ast.parse(textwrap.dedent(source)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == layer]
    found: dict[str, str | None] = {}
    for name in names:
        keywords = {k.arg for call in calls for k in call.keywords
                    if isinstance(k.value, ast.Name) and k.value.id == name and k.arg is not None}
        positional = any(isinstance(a, ast.Name) and a.id == name for call in calls for a in call.args)
        found[name] = keywords.pop() if len(keywords) == 1 and not positional else None
    return found
