"""Plans derived from what transformers declares for a model, checked against the model itself.

transformers puts on a causal LM (built here on the meta device, no memory) a tensor-parallel plan
(``model.tp_plan``: module pattern -> style, merged from the config's ``base_model_tp_plan`` and the class's
``_tp_plan``), a pipeline plan (``model.pp_plan``: embeddings, the layer list, the final norm) and the
decoder layer classes (``_no_split_modules``). ``derive`` maps them onto plait's rules and inspects the
model where they are silent: per-head norms inside attention, the replicated norms of the sequence-parallel
region, scaled embeddings, tied heads, learned position embeddings on later pipeline stages.

Whatever it cannot map correctly becomes a refusal: one line naming the architecture, the module and what
is missing, raised only when a layout needs that plan (tp > 1, sequence parallelism, pp > 1), so tp=pp=1
still trains any model the adapter serves.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn
from transformers.pytorch_utils import Conv1D

from plait import Attention, Column, ConfigError, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead
from plait.meta import build_meta_model
from plait.patterns import matches
from plait.tp.styles import ReplicatedGradSum, ScaledVocabEmbedding, TPRule

# Child names of an attention block's projections, as transformers' models spell them.
Q, K, V = ("q_proj", "query", "q"), ("k_proj", "key", "k"), ("v_proj", "value", "v")
O = ("o_proj", "dense", "out_proj", "o", "c_proj")
# Attention-module attributes that hold a head count read from the config at init: per rank under tp.
LOCAL_ATTRS = {"num_heads": "q_heads", "num_attention_heads": "q_heads", "num_key_value_heads": "kv_heads",
               "num_kv_heads": "kv_heads", "num_key_value_groups": "kv_groups"}
# Head counts an attention forward must not read from the (shared, unsplit) config.
CONFIG_READS = ("config.num_attention_heads", "config.num_key_value_heads")
LINEAR_STYLES = ("colwise", "rowwise")
LM_HEAD_STYLES = ("colwise_gather_output", "colwise_rep", "colwise")  # what transformers gives the LM head


class Refusal(ConfigError):
    """A plan the generic adapter cannot derive correctly; the message names architecture, module, reason."""


@dataclass
class Derived:
    """Everything derived for one model config: each plan, or the reason it cannot be derived."""

    architecture: str
    leaves: list[str]
    tp: TPPlan | Refusal
    sp: SPPlan | Refusal
    pipeline: PipelinePlan | Refusal
    notes: list[str] = field(default_factory=list)


_CACHE: dict[tuple[type, str], Derived] = {}


def derive(config) -> Derived:
    """The plans for ``config``'s causal LM (computed once per distinct config)."""
    key = (type(config), config.to_json_string(use_diff=False))
    if key not in _CACHE:
        _CACHE[key] = _derive(copy.deepcopy(config))
    return _CACHE[key]


def _derive(config) -> Derived:
    model = build_meta_model(config)
    arch = config.model_type
    layers = layer_container(model)
    notes: list[str] = []
    tp = _attempt(lambda: tp_plan(model, config, layers, notes))
    sp = _attempt(lambda: sp_plan(model, arch, layers, tp))
    pipeline = _attempt(lambda: pipeline_plan(model, arch, layers))
    return Derived(arch, [f"{layers}.*"] if layers else [], tp, sp, pipeline, notes)


def _attempt(make):
    try:
        return make()
    except Refusal as refusal:
        return refusal


def refuse(arch: str, module: str, missing: str) -> Refusal:
    return Refusal(f"{arch}: {module}: {missing}")


# --------------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------------


def layer_container(model: nn.Module) -> str | None:
    """The ModuleList of decoder layers: the pp plan's list, else the one holding ``_no_split_modules``."""
    for name in (model.pp_plan or {}):
        if isinstance(_get(model, name), nn.ModuleList):
            return name
    decoder_classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and any(type(c).__name__ in decoder_classes for c in module):
            return name
    return None


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def own_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def layer_pattern(name: str, layers: str) -> str:
    """``model.layers.3.mlp.fc1`` -> ``model.layers.*.mlp.fc1``."""
    if name.startswith(layers + "."):
        rest = name[len(layers) + 1:].partition(".")[2]
        return f"{layers}.*" + (f".{rest}" if rest else "")
    return name


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


# --------------------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------------------


def tp_plan(model: nn.Module, config, layers: str | None, notes: list[str]) -> TPPlan:
    """transformers' tp plan as plait rules: attention blocks, Column / Row linears, per-head norms, the
    vocab-parallel embedding and head; a style plait cannot honour is a Refusal naming it."""
    arch = config.model_type
    declared = dict(model.tp_plan or {})
    if not declared:
        raise refuse(arch, type(model).__name__, "transformers declares no tp plan for it")
    modules = dict(model.named_modules())
    styled: dict[str, str] = {}  # pattern (layer index folded) -> style
    example: dict[str, str] = {}  # pattern -> one module it matches
    for pattern, style in declared.items():
        hits = [name for name in modules if matches(pattern, name)]
        if not hits:
            params = [n for n, _ in model.named_parameters() if matches(pattern, n)]
            if params:
                raise refuse(arch, pattern, f"transformers shards the parameter itself ({style}); plait has no rule for "
                                            f"a bare parameter")
            notes.append(f"{pattern} ({style}) matches no module of this config: ignored")
            continue
        for name in hits:
            folded = layer_pattern(name, layers) if layers else name
            styled[folded] = style
            example.setdefault(folded, name)
    embedding, head = _embedding_rules(model, styled, notes)
    rules: list[TPRule] = [*embedding, *head]
    children: dict[str, dict[str, str]] = defaultdict(dict)
    blocks: dict[str, nn.Module] = {}
    for pattern, style in styled.items():
        if modules[example[pattern]] in (model.get_input_embeddings(), model.get_output_embeddings()):
            continue
        parent, _, child = pattern.rpartition(".")
        children[parent][child] = style
        blocks.setdefault(parent, model.get_submodule(example[pattern].rpartition(".")[0]))
    for parent, styles in children.items():
        rules += _block_rules(model, config, parent, blocks[parent], styles)
    return TPPlan(tuple(rules))


def _embedding_rules(model, styled, notes) -> tuple[list[TPRule], list[TPRule]]:
    """Vocab-parallel embedding and head. An embedding subclass with its own forward plait does not know
    stays replicated (and so does a head tied to it), which is always correct."""
    names = {id(m): n for n, m in model.named_modules()}
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    emb_name, head_name = names.get(id(emb)), names.get(id(out)) if out is not None else None
    tied = out is not None and out.weight is emb.weight
    embedding: list[TPRule] = []
    if styled.get(emb_name) in ("embedding_rowwise", "embedding_colwise"):
        if type(emb) is nn.Embedding:
            embedding = [VocabEmbedding(emb_name)]
        elif isinstance(getattr(emb, "scalar_embed_scale", None), (int, float)):
            embedding = [ScaledVocabEmbedding(emb_name)]
        else:
            notes.append(f"{emb_name} ({type(emb).__name__}) has its own forward: kept replicated")
    head: list[TPRule] = []
    if head_name and styled.get(head_name) in LM_HEAD_STYLES and is_linear(out) and (embedding or not tied):
        head = [VocabHead(head_name)]
    elif head_name:
        notes.append(f"{head_name} kept replicated" + (" (tied to a replicated embedding)" if tied else ""))
    return embedding, head


def _block_rules(model, config, parent: str, block: nn.Module, styles: dict[str, str]) -> list[TPRule]:
    arch = config.model_type
    roles = {role: next((c for c in names if c in styles), None) for role, names in (("q", Q), ("k", K), ("v", V), ("o", O))}
    if roles["q"] and roles["k"] and roles["v"]:
        return _attention_rules(config, parent, block, styles, roles)
    if is_attention(block):
        raise refuse(arch, parent, f"attention whose projections {sorted(styles)} are not separate q, k, v (a fused "
                                   f"layout); plait has no rule for it")
    rules: list[TPRule] = []
    for child, style in styles.items():
        name = f"{parent}.{child}"
        module = block.get_submodule(child)
        if style not in LINEAR_STYLES:
            raise refuse(arch, name, f"transformers' style {style!r} has no plait rule")
        if not is_linear(module):
            raise refuse(arch, name, f"{style} on a {type(module).__name__}; plait splits only Linear / Conv1D")
        rules.append(Column(name) if style == "colwise" else Row(name))
    if not (any(isinstance(r, Column) for r in rules) and any(isinstance(r, Row) for r in rules)):
        raise refuse(arch, parent, f"{sorted(styles)} do not pair column-parallel with row-parallel projections, so "
                                   f"the split activations would leave the block")
    stray = [n for n, m in block.named_modules() if n and n not in styles and own_params(m)]
    if stray:
        raise refuse(arch, f"{parent}.{stray[0]}", "replicated parameters inside a tensor-parallel block see split "
                                                    "activations; plait cannot tell how to sum their gradients")
    return rules


def _attention_rules(config, parent, block, styles, roles) -> list[TPRule]:
    """One Attention rule (heads from the config, checked against the projections' shapes), per-head norms
    as ReplicatedGradSum."""
    arch = config.model_type
    for role in ("q", "k", "v"):
        if styles[roles[role]] != "colwise":
            raise refuse(arch, f"{parent}.{roles[role]}",
                         f"transformers' style {styles[roles[role]]!r} gathers the projection's output (a norm or op "
                         f"over the full width follows); plait has no rule for it")
    if not roles["o"] or styles[roles["o"]] != "rowwise":
        raise refuse(arch, parent, f"attention without a row-parallel output projection ({styles})")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(block, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
    widths = {role: _out_features(_get(block, roles[role])) for role in ("q", "k", "v")}
    expected = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    if widths != expected:
        raise refuse(arch, parent, f"projection widths {widths} are not heads x head_dim {expected} "
                                   f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}, head_dim={head_dim})")
    source = inspect.getsource(type(block).forward)
    reads = [r for r in CONFIG_READS if r in source]
    if reads:
        raise refuse(arch, parent, f"{type(block).__name__}.forward reads {reads[0]} from the shared config; a "
                                   f"per-rank head count cannot be set there")
    rules: list[TPRule] = []
    projections = {roles[r] for r in ("q", "k", "v", "o")}
    for child, style in styles.items():
        if child in projections:
            continue
        if style != "replicated_with_grad_allreduce":
            raise refuse(arch, f"{parent}.{child}", f"transformers' style {style!r} inside attention has no plait rule")
    for name, module in block.named_modules():
        if not name or name in projections or not own_params(module):
            continue
        if any(p.dim() != 1 or p.shape[0] != head_dim for p in own_params(module)):
            raise refuse(arch, f"{parent}.{name}", f"a replicated module inside attention whose parameters are not "
                                                   f"per head (head_dim={head_dim}); its input is split over tp")
        rules.append(ReplicatedGradSum(f"{parent}.{name}"))
    local = {attr: q for attr, q in LOCAL_ATTRS.items() if isinstance(vars(block).get(attr), int)}
    return [Attention(parent, q=roles["q"], k=roles["k"], v=roles["v"], o=roles["o"], num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, local_attrs=local), *rules]


def is_attention(block: nn.Module) -> bool:
    """An attention module: reshaped by heads, so splitting it needs an Attention rule, not Column / Row."""
    name = type(block).__name__
    return "Attention" in name or "Attn" in name or any(hasattr(block, a) for a in ("head_dim", "head_size"))


def _out_features(module: nn.Module) -> int:
    return module.weight.shape[1] if isinstance(module, Conv1D) else module.out_features


# --------------------------------------------------------------------------------------------------
# Sequence parallelism
# --------------------------------------------------------------------------------------------------


def sp_plan(model: nn.Module, arch: str, layers: str | None, tp: TPPlan | Refusal) -> SPPlan:
    """From the first decoder layer to the final norm; every replicated module with parameters in between
    must be token-wise (a norm: 1-D parameters only), or its work on sequence shards would be wrong."""
    if isinstance(tp, Refusal):
        raise tp
    if layers is None:
        raise refuse(arch, type(model).__name__, "no decoder layer list found (pp plan or _no_split_modules)")
    end = _final_norm(model, arch, layers)
    covered = [r.pattern for r in tp.rules]
    norms: list[str] = []
    for name, module in model.get_submodule(layers).named_modules(prefix=layers):
        pattern = layer_pattern(name, layers)
        if not own_params(module) or pattern in norms:
            continue
        if any(pattern == c or pattern.startswith(c + ".") for c in covered):
            continue  # sharded, or inside an attention block (its own rules account for it)
        if any(p.dim() > 1 for p in own_params(module)):
            raise refuse(arch, pattern, f"{type(module).__name__} has replicated matrices inside the decoder layers "
                                        f"(e.g. a state-space or recurrent mixer); on sequence shards it would be "
                                        f"wrong: disable sequence parallelism")
        norms.append(pattern)
    return SPPlan(begin=f"{layers}.0", end=end, norms=(*norms, end))


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


# --------------------------------------------------------------------------------------------------
# Pipeline parallelism
# --------------------------------------------------------------------------------------------------


def pipeline_plan(model: nn.Module, arch: str, layers: str | None) -> PipelinePlan:
    """transformers' pp plan in execution order: what runs before the layer list goes to the first stage,
    what runs after it (and the LM head) to the last. Parameter-free modules it does not name (rotary tables)
    every stage recomputes; modules with parameters it does not name are a Refusal. Parameterised modules
    before the layers other than the input embedding (learned position embeddings) are neutralised on the
    stages that do not own them."""
    if layers is None:
        raise refuse(arch, type(model).__name__, "no decoder layer list found (pp plan or _no_split_modules)")
    plan = model.pp_plan or {}
    parent = layers.rpartition(".")[0]
    siblings = [f"{parent}.{n}" if parent else n for n in model.get_submodule(parent)._modules]
    ordered = [n for n in plan if n in siblings]
    if layers not in ordered:
        ordered = siblings
    cut = ordered.index(layers)
    first, last = ordered[:cut], ordered[cut + 1:]
    for name in siblings:
        if name not in ordered:
            if own_params_deep(_get(model, name)):
                raise refuse(arch, name, "has parameters but transformers' pp plan does not place it on a stage")
            first.append(name)
    outer = [n for n in model._modules if parent and n != parent.split(".")[0]]
    for name in outer:
        if own_params_deep(model.get_submodule(name)) and model.get_submodule(name) is not model.get_output_embeddings():
            raise refuse(arch, name, "has parameters outside the decoder and is not the LM head; plait cannot stage it")
        last.append(name)
    embedding = model.get_input_embeddings()
    neutralize = [n for n in first if own_params_deep(_get(model, n)) and _get(model, n) is not embedding]
    return PipelinePlan(first=tuple(first), layers=layers, last=tuple(last), neutralize=tuple(neutralize))


def own_params_deep(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())
