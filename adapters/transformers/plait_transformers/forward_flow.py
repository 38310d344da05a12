"""What a model's forward hands its decoder layers, read from its source with ``ast``: the children with parameters
a call runs (``callees``), those whose output a name of the forward may hold (``taint_of``) and an expression reads
(``sources``), leaving out what every pipeline stage rebuilds from the full sequence (``STAGE_BUILT``). The
sequence-parallel region (sp_region: the side inputs it splits like the hidden states) and the pipeline stages
(pipeline_stages: the modules every stage runs itself) both follow these values, and both refuse a module with
parameters before the layers whose output reaches them beside the hidden states (``check_no_side_inputs``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections import defaultdict

from torch import nn

from plait_transformers.common import refuse


# The names of methods for another modality's inputs (``get_image_features``).
MODALITY = r"image|audio|video|vision|pixel|speech"


@functools.cache
def source_of(function) -> str:
    """``function``'s source, or "" where it has none to read; kept: ``users_of`` reads every method of a model
    class, most of them PreTrainedModel's, the same for every architecture (tokenizing them took about 1 s a
    model)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def check_no_side_inputs(model: nn.Module, arch: str, layers: str, modules: list[str], why: str) -> None:
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
        for call in calls_of(tree, inner):
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


def calls_of(tree: ast.AST, child: str) -> list[ast.Call]:
    """The calls of ``self.<child>`` in ``tree``, and of the loop variable of a loop over it (the layers)."""
    loops = {n.id for loop in ast.walk(tree) if isinstance(loop, ast.For) and f"self.{child}" in ast.unparse(loop.iter)
             for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        _calls_self(n, child) or isinstance(n.func, ast.Name) and n.func.id in loops)]


def users_of(owner: type, child: str) -> list[str]:
    """The methods of ``owner`` other than its forward that use ``self.<child>`` (Gemma's ``get_per_layer_inputs``
    for ``embed_tokens_per_layer``): a call of one in the forward runs the child there. Another modality's
    (``get_image_features``) are left out: text training never runs them (``pipeline_stages._modality_only``)."""
    return [name for name, attributes in _attributes_used(owner).items() if child in attributes]


@functools.cache
def _attributes_used(owner: type) -> dict[str, frozenset[str]]:
    """For each method of ``owner`` ``users_of`` may name, the ``self.<name>`` attributes its source reads: read
    once per model class (a class has some 200 methods, most PreTrainedModel's; searching them all for each child
    of each model a derivation looks at was 4% of the conformance kit's time)."""
    return {name: frozenset(re.findall(r"\bself\.(\w+)", source_of(method)))
            for name, method in inspect.getmembers(owner, inspect.isfunction)
            if not name.startswith("__") and name != "forward" and not re.search(MODALITY, name)}


def layer_params(model: nn.Module, layers: str) -> list[str]:
    """The names of the first decoder layer's forward parameters (after ``self``): what positional arguments are."""
    params = list(inspect.signature(type(model.get_submodule(layers)[0]).forward).parameters)
    return params[1:]


def callees(call: ast.Call, called: dict[str, set[str]]) -> set[str]:
    """The child modules a call runs: ``self.<child>(...)``, ``self.<child>[i](...)`` or ``self.<method>(...)`` of
    a method using them (``called``: method or child name -> child names)."""
    func = call.func.value if isinstance(call.func, ast.Subscript) else call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return called.get(func.attr, set())
    return set()


# The forward argument every stage can be given (``PipelinePlan.token_ids``), a source of its own in ``sources``.
TOKEN_IDS = "input_ids"


# Reading these off a tensor reads no values; a mask builder (transformers' create_causal_mask) reads only them
# of its inputs_embeds, and every stage rebuilds its masks (``STAGE_BUILT``).
SHAPE_ATTRIBUTES = ("shape", "dtype", "device", "size", "ndim", "dim")


def sources(node: ast.AST, taint: dict[str, set[str]], called: dict[str, set[str]],
             opaque: frozenset[int] = frozenset()) -> set[str]:
    """The child modules whose output ``node`` reads: the calls in it and the names it reads (``taint``), but
    not through a tensor's shape, dtype or device, a mask builder, or the nodes ``opaque`` names (by id)."""
    if id(node) in opaque or isinstance(node, ast.Attribute) and node.attr in SHAPE_ATTRIBUTES:
        return set()
    if isinstance(node, ast.Name):
        return set(taint.get(node.id, ())) | ({TOKEN_IDS} if node.id == TOKEN_IDS else set())
    if isinstance(node, ast.IfExp) and (given := _ids_given(node.test)) is not None:  # the stages pass input_ids
        return sources(node.body if given else node.orelse, taint, called, opaque)
    found: set[str] = set()
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if "mask" in name.lower() and not callees(node, called):
            return set()
        found |= callees(node, called)
    for child in ast.iter_child_nodes(node):
        found |= sources(child, taint, called, opaque)
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


def assigned_names(node: ast.AST) -> set[str]:
    """The names the assignment statements anywhere under ``node`` change (``_assigned`` of each target)."""
    return {name for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in (n.targets if isinstance(n, ast.Assign) else [n.target]) for name in _assigned(target)}


def taint_of(tree: ast.AST, called: dict[str, set[str]], layer_calls: list[ast.Call]) -> dict[str, set[str]]:
    """Each name of the forward -> the child modules whose output it may hold, through any assignment (a loop
    target, ``x.append(y)``, ``x[k] = y``), iterated to a fixed point; not through the layers (``layer_calls``):
    what they hand each other is ``pipeline_stages._check_layer_inputs``' to judge."""
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
            found = sources(value, taint, called, opaque)
            for name in targets:
                if not found <= taint[name]:
                    taint[name] |= found
                    changed = True
    return taint


# Decoder-layer inputs every pipeline stage rebuilds itself from the full sequence (docs/decisions.md D2).
STAGE_BUILT = ("attention_mask", "position_embeddings", "position_ids", "cache_position", "past_key_values")
