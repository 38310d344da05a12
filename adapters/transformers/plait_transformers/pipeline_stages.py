"""The pipeline stages, derived from transformers' pp plan or, where it is silent, from the order the forward uses
the modules beside the layer list: which go to the first stage and which to the last, which every stage holds and
runs itself (their output reaches the layers beside the hidden states), and what a layer hands the next besides
the hidden states. Refused where stages would not compute what one process does: layers run several times per
forward, values threaded from layer to layer other than by keyword, keys and values shared across layers, modules
with parameters that no stage order places.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections import defaultdict

from torch import nn

from plait import PipelinePlan
from plait.base.meta import language_model_name

from plait_transformers.common import NO_LAYERS, get_module, holds, own_params_deep, refuse
from plait_transformers.forward_flow import (
    HIDDEN_ARGUMENTS, MODALITY, STAGE_BUILT, TOKEN_IDS, calls_of, callees, check_no_side_inputs, layer_params,
    source_of, sources, taint_of, users_of,
)


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
    check_no_side_inputs(model, arch, layers, neutralize, "only the first pipeline stage would hold it: use pp=1")
    return PipelinePlan(first=tuple(first), layers=layers, last=tuple(last), neutralize=tuple(neutralize),
                        layer_outputs=outputs, none_outputs=none, every_stage=tuple(every),
                        token_ids=bool(every) or reads_ids, carried=carried, first_params=_merging_params(model))


def _merging_params(model: nn.Module) -> tuple[str, ...]:
    """An image-text model's parameters of its own on the modules that hold both the vision tower and the language
    model (LLaVA-NeXT's ``image_newline``): what they compute with is the merging of the images into the embeddings,
    before the language model, so the first pipeline stage's."""
    decoder = language_model_name(model)
    if decoder is None:
        return ()
    holders = [decoder.rsplit(".", depth)[0] for depth in range(1, decoder.count(".") + 1)] + [""]
    return tuple(f"{holder}.{leaf}" if holder else leaf for holder in holders
                 for leaf, param in model.get_submodule(holder).named_parameters(recurse=False) if param is not None)


def _check_no_shared_keys_and_values(model: nn.Module, arch: str, layers: str) -> None:
    """Gemma-3n's and Gemma-4's last ``config.num_kv_shared_layers`` layers attend with the keys and values of an
    earlier layer, handed to them in ``shared_kv_states`` (a mapping every layer gets, which the forward builds
    before its loop): on a later stage than that layer they would find none. Refused where any layer reuses them."""
    config = getattr(model, "config", None)
    shared = getattr(config.get_text_config(), "num_kv_shared_layers", 0) if config is not None else 0
    parent = layers.rpartition(".")[0]
    source = source_of(type(model.get_submodule(parent) if parent else model).forward)
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
             if not name.startswith("__") and f"self.{child}" in source_of(method)]  # __init__ builds it
    return bool(users) and all(re.search(MODALITY, name) for name in users)


def _staged_by_children(model: nn.Module, first: list[str]) -> list[str]:
    """``first`` with a block that holds the input embedding among other modules (BERT's embeddings: word and
    position embeddings, a LayerNorm) replaced by its children: later stages run the block's forward on a stand-in
    for the embeddings, so only its parts can be owned by the first stage and neutralised elsewhere."""
    embedding = model.get_input_embeddings()
    out: list[str] = []
    for name in first:
        module = model.get_submodule(name)
        if module is not embedding and holds(module, embedding):
            out += _staged_by_children(model, [f"{name}.{child}" for child in module._modules])
        else:
            out.append(name)
    return out


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


def _uses(owner: type, source: str, child: str) -> list[int]:
    """Where ``source`` (``owner``'s forward) uses ``self.<child>``; where it never names it, where it calls a
    method using it (``users_of``)."""
    found = [m.start() for m in re.finditer(rf"\bself\.{child}\b", source)]
    if found:
        return found
    return sorted(m.start() for name in users_of(owner, child) for m in re.finditer(rf"\bself\.{name}\(", source))


def _every_stage(model: nn.Module, layers: str, first: list[str]) -> tuple[list[str], bool]:
    """The modules of ``first`` with parameters whose output reaches the layers other than as the hidden states
    (Gemma's per-layer embeddings and projection, CPM-Ant's position bias, handed to the block holding the
    layers), and, for those, the modules whose output they read (Gemma's input embedding, which the projection
    reads). They run before any layer, so on the batch alone: every pipeline stage can compute them as the first
    does, if it holds them (``PipelinePlan.every_stage``). Found at each module holding the layer list
    (``_every_stage_at``). Also whether the layers get the forward's ``input_ids`` (DeepSeek-V4's hash routing,
    Qwen4-Exp's per-layer embeddings): every stage then runs the model on the token ids (``PipelinePlan.token_ids``)."""
    every, reads_ids = _every_stage_at(model, layers, first, layer_params(model, layers))
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
    source = source_of(owner.forward)
    if not source:
        return [], False
    tree = ast.parse(textwrap.dedent(source))
    children = {n.rpartition(".")[2]: n for n in first
                if n.rpartition(".")[0] == parent and own_params_deep(get_module(model, n))}
    called: dict[str, set[str]] = defaultdict(set)  # method or child name -> the children a call of it runs
    for child in children:
        called[child].add(child)
        for method in users_of(owner, child):
            called[method].add(child)
    calls = calls_of(tree, path.rpartition(".")[2])
    taint = taint_of(tree, called, calls)
    side = set()
    for call in calls:
        named = [(params[i] if i < len(params) else None, a) for i, a in enumerate(call.args)][1:]
        named += [(k.arg, k.value) for k in call.keywords]
        side |= {c for name, value in named if name not in (*STAGE_BUILT, *HIDDEN_ARGUMENTS)
                 for c in sources(value, taint, called)}
    reads_ids = TOKEN_IDS in side
    side.discard(TOKEN_IDS)
    every, todo = set(side), list(side)
    while todo:  # what the every-stage modules read, they need too
        child = todo.pop()
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and child in callees(call, called):
                found = {c for a in (*call.args, *(k.value for k in call.keywords))
                         for c in sources(a, taint, called)} - every - {TOKEN_IDS}
                every |= found
                todo += found
    return [children[c] for c in children if c in every], reads_ids


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
