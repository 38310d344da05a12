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
import re
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn
from transformers.activations import ACT2CLS
from transformers.pytorch_utils import Conv1D

from plait import Attention, Column, ConfigError, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead
from plait.meta import build_meta_model
from plait.patterns import matches
from plait.tp.sharding import linear_shape
from plait.tp.styles import (
    FullWidthNormAttention, FusedColumn, HeadInterleavedAttention, LocalConfigAttention, MoEExperts, MoERouter,
    ReplicatedGradSum, ScaledVocabEmbedding, TPRule, WholeSequence,
)
from plait.tp.styles import ExpertMajorExperts, LatentAttention

# Child names of an attention block's projections, as transformers' models spell them.
Q, K, V = ("q_proj", "query", "q"), ("k_proj", "key", "k"), ("v_proj", "value", "v")
O = ("o_proj", "dense", "out_proj", "o", "c_proj")
QKV = ("qkv_proj", "query_key_value", "qkv", "Wqkv", "c_attn")  # fused q, k and v
# Attention-module attributes that hold a head count read from the config at init: per rank under tp.
LOCAL_ATTRS = {"num_heads": "q_heads", "num_attention_heads": "q_heads", "num_key_value_heads": "kv_heads",
               "num_kv_heads": "kv_heads", "num_key_value_groups": "kv_groups"}
# Head counts an attention forward must not read from the (shared, unsplit) config.
CONFIG_READS = {"config.num_attention_heads": "q_heads", "config.num_key_value_heads": "kv_heads"}
LINEAR_STYLES = ("colwise", "rowwise")
# transformers' styles that gather a column-parallel output / split a row-parallel input again because an op
# over the full width sits between them (a fused projection's split, a norm over all heads): plait splits for
# real where it knows that op (FusedColumn, fused qkv layouts, SplitNorm) and refuses otherwise.
GATHERED = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}
# transformers' marker on the owner of bare parameters (attention sinks) that their own entries shard
LOCAL_PARAMS = "local_params"
MOE_STYLES = ("moe_tp_experts",)  # transformers' fused experts module (gate_up_proj [E, 2I, H], down_proj)
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
    arch = config.model_type
    try:
        model = build_meta_model(config)
    except Exception as err:  # transformers' own error for a config it cannot build: one line, not a traceback
        refusal = refuse(arch, type(config).__name__, f"transformers cannot build the model: {_one_line(err)}")
        return Derived(arch, [], refusal, refusal, refusal)
    layers = layer_container(model)
    notes: list[str] = []
    tp = _attempt(arch, lambda: tp_plan(model, config, layers, notes))
    sp = _attempt(arch, lambda: sp_plan(model, arch, layers, tp))
    pipeline = _attempt(arch, lambda: pipeline_plan(model, arch, layers))
    return Derived(arch, [f"{layers}.*"] if layers else [], tp, sp, pipeline, notes)


def _attempt(arch: str, make):
    """The plan ``make`` derives, or the reason it cannot: an exception transformers raises while plait
    inspects the model (a KeyError from an unusual module) becomes a one-line refusal, not a traceback."""
    try:
        return make()
    except Refusal as refusal:
        return refusal
    except Exception as err:
        return Refusal(f"{arch}: transformers raised {_one_line(err)} while plait inspected the model")


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: " + " ".join(str(err).split())


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
    moe = [p for p, style in declared.items() if style in MOE_STYLES]
    bare: dict[str, dict[str, str]] = defaultdict(dict)  # parent pattern -> {parameter: style}
    for pattern, style in declared.items():
        if style == LOCAL_PARAMS:
            continue  # marks the owner of bare parameters sharded by their own entries (handled with those)
        hits = [name for name in modules if matches(pattern, name)]
        if not hits:
            params = [n for n, _ in model.named_parameters() if matches(pattern, n)]
            if params and any(pattern.startswith(m + ".") for m in moe):
                continue  # an experts module's own parameter: MoEExperts splits it
            if params:
                parent, _, leaf = pattern.rpartition(".")
                bare[parent][leaf] = style  # an attention block's per-head parameter (sinks), else refused below
                continue
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
    _unplanned_latent_attention(model, layers, children, blocks, notes)
    for pattern, (block, styles, sinks) in undeclared_attention(model, layers, children).items():
        children[pattern], blocks[pattern] = styles, block
        bare[pattern].update(sinks)
        notes.append(f"{pattern} ({type(block).__name__}): attention transformers' plan leaves out, split by heads as "
                     f"a declared one (q/k/v column-, o row-parallel)")
    moe_blocks = {p for p, styles in children.items() if any(style in MOE_STYLES for style in styles.values())}
    for parent, styles in children.items():
        if any(parent.startswith(block + ".") for block in moe_blocks):
            # a shared expert: it runs on the MoE block's flattened tokens ([tokens, hidden]), which under SP the
            # sequence all-gather of a Column cannot take; replicated it is exact (token-wise) in every layout
            notes.append(f"{parent} ({sorted(styles)}) inside an MoE block: kept replicated, token by token")
            continue
        experts = [c for c, style in styles.items() if style in MOE_STYLES]
        if experts:
            rules += _moe_rules(model, config, parent, styles, experts)
        else:
            rules += _block_rules(model, config, parent, blocks[parent], styles, bare.pop(parent, {}))
    for parent, params in bare.items():
        raise bare_refusal(arch, parent, params)
    rules += undeclared_mixers(model, arch, layers, rules, notes)
    return TPPlan(tuple(rules))


def _moe_rules(model, config, parent: str, styles: dict[str, str], experts: list[str]) -> list:
    """A sparse MoE block: the fused experts module split on its intermediate dimension (its own tensor-parallel
    region). Every other child with parameters that transformers' plan does not split (the router, a shared
    expert, its gate) stays replicated: it works token by token on the block's flattened tokens, so on every
    rank without SP, and on a sequence shard under SP (its gradient summed over tp), it is exact. Column / Row
    styles on the same (folded) parent are the dense MLP of the layers without experts (DeepSeek-V3's first
    layers); they must pair like any MLP."""
    arch = config.model_type
    modules = dict(model.named_modules())
    _check_no_identity_experts(arch, modules, parent, experts)
    block_name = next(n for n in modules if matches(f"{parent}.{experts[0]}", n)).rpartition(".")[0]
    for name in (n for n in modules if matches(parent, n)):
        block = modules[name]
        if experts[0] in block._modules:
            continue
        if is_attention(block) or any(own_params(m) and not is_linear(m) for _, m in block.named_modules()):
            raise refuse(arch, parent, f"{name} is a {type(block).__name__}, where other layers hold the experts: "
                                       f"layers of different kinds at one module path, which plait's patterns "
                                       f"cannot tell apart")
    rules: list[TPRule] = [_experts_rule(modules, f"{parent}.{e}") for e in experts]
    dense = {c: style for c, style in styles.items() if c not in experts}
    for child, style in dense.items():
        name = f"{parent}.{child}"
        if style not in LINEAR_STYLES or not all(is_linear(modules[n]) for n in modules if matches(name, n)):
            raise refuse(arch, name, f"transformers' style {style!r} beside an experts module has no plait rule")
        rules.append(Column(name) if style == "colwise" else Row(name))
    if dense and sorted(set(dense.values())) != ["colwise", "rowwise"]:
        raise refuse(arch, parent, f"{sorted(dense)} beside the experts do not pair column- with row-parallel "
                                   f"projections")
    if getattr(config, "output_router_logits", False):
        rules += _router_rules(model, arch, parent, modules[block_name])
    return rules


def _experts_rule(modules: dict[str, nn.Module], pattern: str) -> MoEExperts:
    """MoEExperts for transformers' usual experts module (``forward(hidden_states, top_k_index, top_k_weights)``);
    ExpertMajorExperts for one that takes every token once per expert, pre-scaled by its routing score, and views
    them expert-major (Llama4: ``forward(hidden_states)``, ``hidden_states.view(self.gate_up_proj.shape[0], -1,
    ...)``). Any other forward gets MoEExperts, which refuses it naming the arguments it needs."""
    module = next(m for n, m in modules.items() if matches(pattern, n))
    arguments = list(inspect.signature(module.forward).parameters)
    expert_major = "hidden_states.view(self.gate_up_proj.shape[0], -1" in inspect.getsource(type(module).forward)
    return ExpertMajorExperts(pattern) if arguments == ["hidden_states"] and expert_major else MoEExperts(pattern)


def _check_no_identity_experts(arch: str, modules: dict[str, nn.Module], parent: str, experts: list[str]) -> None:
    """Experts split on their intermediate dimension are summed over tp. Zero-compute (identity) experts inside
    the experts module's forward (LongCat-Flash: more gate_up than down experts, an nn.Identity) would be added
    by every rank, tp times: refused."""
    for pattern in (f"{parent}.{e}" for e in experts):
        module = next(m for n, m in modules.items() if matches(pattern, n))
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        counts = {getattr(p, "shape", (None,))[0] for p in (gate_up, down) if isinstance(p, nn.Parameter)}
        if len(counts) > 1 or any(isinstance(m, nn.Identity) for m in module.modules()):
            raise refuse(arch, pattern, "the experts module also runs identity (zero-compute) experts in its forward, "
                                        "which every tensor-parallel rank would add again; plait has no rule for it")


def _router_rules(model, arch: str, parent: str, block: nn.Module) -> list[TPRule]:
    """The router whose logits transformers records for the load-balancing loss (``_can_record_outputs``), as
    a MoERouter: gathered from sequence shards under SP. A loss fed from anything else is refused: on
    sequence shards it would silently see one shard's tokens."""
    recorder = (getattr(model.base_model, "_can_record_outputs", None) or {}).get("router_logits")
    found = [n for n, m in block.named_children() if recorder is not None and type(m) is recorder.target_class]
    if len(found) != 1 or recorder.index != 0:
        raise refuse(arch, parent, "output_router_logits is set, but the router logits transformers records are not "
                                   "the first output of one child of the MoE block; plait cannot gather them")
    return [MoERouter(f"{parent}.{found[0]}")]


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


def undeclared_attention(model: nn.Module, layers: str | None,
                         children: dict[str, dict[str, str]]) -> dict[str, tuple[nn.Module, dict[str, str], dict[str, str]]]:
    """Attention blocks in the decoder layers that transformers' plan leaves out (granitemoe's and phimoe's
    declare only the experts), found by inspecting the model: a block calling transformers' attention functions
    with separate Linear q, k, v and o projections and no styled child gets the styles transformers declares
    for such blocks elsewhere (q/k/v colwise, o rowwise); ``_attention_rules`` checks its widths and heads as for
    a declared one. Its sinks (a parameter the forward passes as the attention functions' ``s_aux``, one logit per q
    head) are split with the q heads, as transformers' plans declare them elsewhere. Keyed by layer pattern: (one
    block, its styles, its sinks' styles)."""
    found: dict[str, tuple[nn.Module, dict[str, str], dict[str, str]]] = {}
    if layers is None:
        return found
    for name, module in model.get_submodule(layers).named_modules(prefix=layers):
        pattern = layer_pattern(name, layers)
        if pattern in children or pattern in found or not is_attention(module):
            continue
        roles = {role: next((c for c in names if isinstance(module._modules.get(c), nn.Linear)), None)
                 for role, names in (("q", Q), ("k", K), ("v", V), ("o", O))}
        source = inspect.getsource(type(module).forward)
        if None in roles.values() or "ALL_ATTENTION_FUNCTIONS" not in source:
            continue
        styles = {roles[r]: "colwise" for r in ("q", "k", "v")}
        gates = {c: "colwise" for c in _output_gates(module, source, set(roles.values()))}
        sinks = {leaf: "colwise" for leaf in module._parameters if f"s_aux=self.{leaf}," in source}
        found[pattern] = (module, {**styles, **gates, roles["o"]: "rowwise"}, sinks)
    return found


def undeclared_mixers(model: nn.Module, arch: str, layers: str | None, rules: list[TPRule],
                      notes: list[str]) -> list[TPRule]:
    """Children of the decoder layers holding matrices that no rule touches and that are not softmax attention
    (a recurrent mixer transformers' plan leaves out, such as OLMo-Hybrid's gated delta net): kept whole on every
    rank, which is exact without SP, and run on the whole sequence under SP (WholeSequence). One rule per layer
    pattern when every layer's module there is untouched, else one per layer."""
    if layers is None:
        return []
    patterns = [r.pattern for r in rules]
    found: dict[str, list[tuple[str, nn.Module]]] = defaultdict(list)  # pattern -> untouched (name, module)
    seen: dict[str, int] = defaultdict(int)  # pattern -> layers holding a child there
    for index, layer in enumerate(model.get_submodule(layers)):
        for child, module in layer.named_children():
            name, pattern = f"{layers}.{index}.{child}", f"{layers}.*.{child}"
            seen[pattern] += 1
            if not any(p.dim() > 1 for p in module.parameters()) or _softmax_attention(module):
                continue
            if not any(_covered(n, patterns) for n, _ in module.named_modules(prefix=name)):
                found[pattern].append((name, module))
    mixers: list[TPRule] = []
    for pattern, hits in found.items():
        names = [pattern] if len(hits) == seen[pattern] else [name for name, _ in hits]
        mlp = gated_mlp(hits[0][1])
        if mlp and all(gated_mlp(module) == mlp for _, module in hits):
            mixers += [style(f"{name}.{child}") for name in names for style, child in zip((Column, Column, Row), mlp)]
            notes.append(f"{pattern} ({type(hits[0][1]).__name__}): an MLP transformers' plan leaves out, split as "
                         f"declared ones ({mlp[0]}, {mlp[1]} column-, {mlp[2]} row-parallel)")
            continue
        each = [whole_sequence(arch, name, module) for name, module in hits]
        mixers += [WholeSequence(pattern, argument=each[0].argument)] if len(hits) == seen[pattern] else each
        notes.append(f"{pattern} ({type(hits[0][1]).__name__}): no rule splits it; kept whole on every rank and run "
                     f"on the whole sequence under SP")
    return mixers


def gated_mlp(block: nn.Module) -> tuple[str, str, str] | None:
    """(gate, up, down) of a gated MLP whose forward is ``down(act(gate(x)) * up(x))`` over three Linear children
    and nothing else with parameters (AFMoE's dense layers; LFM2-MoE's ``w2(F.silu(w1(x)) * w3(x))``), else None."""
    found = re.search(r"self\.(\w+)\(\s*[\w.]+\(self\.(\w+)\((\w+)\)\)\s*\*\s*self\.(\w+)\(\3\)\s*\)",
                      inspect.getsource(type(block).forward))
    if found is None:
        return None
    down, gate, _, up = found.groups()
    names = (gate, up, down)
    with_params = {n for n, m in block.named_modules() if own_params(m)}
    if with_params != set(names) or not all(isinstance(block._modules.get(n), nn.Linear) for n in names):
        return None
    return names


def _output_gates(block: nn.Module, source: str, projections: set[str]) -> list[str]:
    """Linear children of an attention block whose output, read from the block's input, multiplies the attention
    output through a sigmoid (AFMoE: ``gate_states = self.gate_proj(hidden_states)`` ...
    ``output * torch.sigmoid(gate_states)``): elementwise per head, so split with the q heads."""
    gates = []
    for child, module in block.named_children():
        if child in projections or not isinstance(module, nn.Linear):
            continue
        read = re.search(rf"(\w+) = self\.{child}\(hidden_states\)", source)
        if read and f"* torch.sigmoid({read.group(1)}" in source:
            gates.append(child)
    return gates


def _softmax_attention(block: nn.Module) -> bool:
    """Whether a block calls transformers' attention functions (softmax attention over heads)."""
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(type(block).forward)


def whole_sequence(arch: str, pattern: str, block: nn.Module) -> WholeSequence:
    """A block kept whole on every rank and run on the whole sequence under SP (a recurrent or state-space mixer):
    WholeSequence gathers its forward's first argument, the hidden states."""
    first = next(iter(inspect.signature(block.forward).parameters), None)
    if first is None:
        raise refuse(arch, pattern, f"{type(block).__name__} is kept whole and must see the whole sequence under SP, but "
                                    f"its forward takes no hidden states")
    return WholeSequence(pattern, argument=first)


def bare_refusal(arch: str, parent: str, params: dict[str, str]) -> Refusal:
    """The refusal for parameters transformers' plan shards by themselves where plait has no rule for them."""
    leaf, style = next(iter(params.items()))
    return refuse(arch, f"{parent}.{leaf}", f"transformers shards the parameter itself ({style}); plait splits bare "
                                            f"parameters only with the q heads of a q/k/v attention block")


def _block_rules(model, config, parent: str, block: nn.Module, styles: dict[str, str],
                 bare: dict[str, str]) -> list[TPRule]:
    """The rules of one block transformers' plan styles children of (``bare``: its parameters the plan styles)."""
    arch = config.model_type
    roles = {role: next((c for c in names if c in styles), None) for role, names in (("q", Q), ("k", K), ("v", V), ("o", O))}
    if roles["q"] and roles["k"] and roles["v"]:
        return _attention_rules(model, config, parent, styles, roles, bare)
    if bare:
        raise bare_refusal(arch, parent, bare)
    fused = next((c for c in QKV if c in styles), None)
    if fused and roles["o"]:
        return _fused_attention_rules(config, parent, block, styles, fused, roles["o"])
    if is_latent_attention(block):
        return _latent_attention_rules(model, config, parent, block, styles)
    if all(style == "colwise_gather_output" for style in styles.values()) and not _softmax_attention(block):
        # transformers gathers every projection's output: it computes the block whole on every rank
        return [whole_sequence(arch, parent, block)]
    if is_attention(block):
        raise refuse(arch, parent, f"attention whose projections {sorted(styles)} are neither separate q, k, v nor "
                                   f"a fused qkv plait knows; plait has no rule for it")
    rules: list[TPRule] = []
    for child, style in styles.items():
        name = f"{parent}.{child}"
        module = block.get_submodule(child)
        if style not in LINEAR_STYLES and style not in GATHERED:
            raise refuse(arch, name, f"transformers' style {style!r} has no plait rule")
        if not is_linear(module):
            raise refuse(arch, name, f"{style} on a {type(module).__name__}; plait splits only Linear / Conv1D")
        if style == "colwise_gather_output":
            rules.append(_fused_column(arch, name, block, child, styles))
        else:
            rules.append(Column(name) if style == "colwise" else Row(name))
    if not (any(isinstance(r, Column) for r in rules) and any(isinstance(r, Row) for r in rules)):
        raise refuse(arch, parent, f"{sorted(styles)} do not pair column-parallel with row-parallel projections, so "
                                   f"the split activations would leave the block")
    stray = [n for n, m in block.named_modules() if n and n not in styles and own_params(m)]
    columns = [r.pattern.rpartition(".")[2] for r in rules if isinstance(r, Column)]
    unknown = [n for n in stray if not _scalar_activation(block, n, columns)]
    if unknown:
        raise refuse(arch, f"{parent}.{unknown[0]}", "replicated parameters inside a tensor-parallel block see split "
                                                     "activations; plait cannot tell how to sum their gradients")
    return [*rules, *(ReplicatedGradSum(f"{parent}.{n}") for n in stray)]


def _scalar_activation(block: nn.Module, child: str, columns: list[str]) -> bool:
    """Whether ``child`` is one of transformers' activation functions (elementwise) whose parameters are single
    numbers (Apertus' xIELU ``alpha_p``, ``alpha_n``: shape [1], broadcast over every feature), applied by the
    block's forward directly to a column-parallel projection's output. Each rank then computes their gradient over
    its own slice of the features only, and the sum over tp is exact (ReplicatedGradSum). A per-feature
    parameter, or one applied elsewhere (to the block's unsplit input), is not this case."""
    module = block.get_submodule(child)
    activations = {c[0] if isinstance(c, tuple) else c for c in ACT2CLS.values()}
    if "." in child or type(module) not in activations or any(p.numel() != 1 for p in module.parameters()):
        return False
    source = inspect.getsource(type(block).forward)
    return any(re.search(rf"self\.{child}\(\s*self\.{column}\(", source) for column in columns)


def _fused_column(arch: str, name: str, block: nn.Module, child: str, styles: dict[str, str]) -> TPRule:
    """A column-parallel projection transformers gathers because its output is two projections side by side
    (``gate_up_proj``: gate | up, chunked in two and multiplied): each rank keeps matching halves (FusedColumn).
    Anything else gathered is refused: plait cannot tell which full-width op follows it."""
    rows = [c for c, style in styles.items() if GATHERED.get(style, style) == "rowwise"]
    fan_in = linear_shape(block.get_submodule(rows[0]))[0] if len(rows) == 1 else None
    if "gate_up" in child and ".chunk(2" in inspect.getsource(type(block).forward) and \
            _out_features(block.get_submodule(child)) == 2 * (fan_in or -1):
        return FusedColumn(name, chunks=2)
    raise refuse(arch, name, "transformers gathers this projection's output (colwise_gather_output) for an op over "
                             "the full width that plait does not know; it has no real split for it")


def _fused_attention_rules(config, parent, block, styles, qkv: str, o: str) -> list[TPRule]:
    """Attention with one fused q/k/v projection, in one of the two layouts transformers' models use, read from
    the forward's source: q | k | v side by side, sliced at ``num_attention_heads * head_dim`` (Phi3
    ``qkv_proj``; LocalConfigAttention gives the block a config holding this rank's head counts), or head by
    head, viewed as (heads, 3 * head_dim) and chunked in three (GPT-NeoX ``query_key_value``;
    HeadInterleavedAttention). Any other layout is refused."""
    arch = config.model_type
    if GATHERED.get(styles[o], styles[o]) != "rowwise" or GATHERED.get(styles[qkv], styles[qkv]) != "colwise":
        raise refuse(arch, parent, f"fused attention styles {styles} are not column-parallel qkv and row-parallel out")
    stray = [n for n, m in block.named_modules() if n and n not in (qkv, o) and own_params(m)]
    if stray or len(styles) != 2:
        raise refuse(arch, f"{parent}.{(stray or sorted(set(styles) - {qkv, o}))[0]}",
                     "a module inside fused attention beside qkv and out; plait has no rule for it")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(block, "head_dim", None) or getattr(block, "head_size", None) or \
        getattr(config, "head_dim", None) or config.hidden_size // heads
    width = _out_features(block.get_submodule(qkv))
    if width != (heads + 2 * kv_heads) * head_dim:
        raise refuse(arch, f"{parent}.{qkv}", f"fused width {width} is not (heads + 2 kv heads) x head_dim = "
                                              f"({heads} + 2 x {kv_heads}) x {head_dim}")
    source = inspect.getsource(type(block).forward)
    local = {attr: q for attr, q in LOCAL_ATTRS.items() if isinstance(vars(block).get(attr), int)}
    common = dict(qkv=qkv, o=o, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, local_attrs=local)
    interleaved = ".chunk(3" in source and ("3 * self.head_size" in source or "3 * self.head_dim" in source)
    if interleaved and kv_heads == heads:
        return [HeadInterleavedAttention(parent, **common)]
    sliced = "config.num_attention_heads * self.head_dim" in source
    if sliced and not interleaved:
        reads = {r.partition(".")[2]: q for r, q in CONFIG_READS.items() if r in source}
        return [LocalConfigAttention(parent, config_attrs=reads, **common)]
    raise refuse(arch, f"{parent}.{qkv}", f"{type(block).__name__}.forward splits its fused qkv in a layout plait does "
                                          f"not recognise (neither q|k|v sliced by head counts nor per-head "
                                          f"interleaved)")


def _attention_rules(model, config, parent, styles, roles, bare) -> list[TPRule]:
    """The Attention rule(s) of the blocks ``parent`` matches: heads from the config, or per layer from the
    projections' widths where the block's own head-count attributes confirm them (one rule per layer when
    layers differ); q projections carrying a per-head gate (``q_chunks``); colwise children whose output is per
    q head (``head_columns``: gates) and per-head bare parameters (``bare``: sinks) split with the q heads, as
    transformers' own colwise splits them; per-head norms as ReplicatedGradSum."""
    arch = config.model_type
    gathered = any(styles[roles[r]] == "colwise_gather_output" for r in ("q", "k", "v"))
    for role in ("q", "k", "v"):
        if GATHERED.get(styles[roles[role]], styles[roles[role]]) != "colwise":
            raise refuse(arch, f"{parent}.{roles[role]}", f"transformers' style {styles[roles[role]]!r} on a q/k/v "
                                                          f"projection has no plait rule")
    if not roles["o"] or GATHERED.get(styles[roles["o"]], styles[roles["o"]]) != "rowwise":
        raise refuse(arch, parent, f"attention without a row-parallel output projection ({styles})")
    matched = {name: module for name, module in model.named_modules() if matches(parent, name)}
    blocks = {name: b for name, b in matched.items() if all(_get(b, roles[r]) is not None for r in ("q", "k", "v", "o"))}
    # other layers' blocks at this path without these projections: a linear attention (MiniMax's lightning
    # attention) is kept whole on every rank and run on the whole sequence; anything else is refused
    others = {name: b for name, b in matched.items() if name not in blocks}
    kinds = {type(b) for b in blocks.values()}
    if len(kinds) > 1:
        raise refuse(arch, parent, f"attention blocks of different classes {sorted(k.__name__ for k in kinds)} "
                                   f"at one module path, which plait's patterns cannot tell apart")
    lacking = next((name for name, b in others.items() if _softmax_attention(b)), None)
    if lacking is not None:
        missing = sorted(roles[r] for r in ("q", "k", "v", "o") if _get(matched[lacking], roles[r]) is None)
        raise refuse(arch, parent, f"{lacking} ({type(matched[lacking]).__name__}) is softmax attention without "
                                   f"{missing}, unlike other layers' blocks at this path; plait has no rule for it")
    mixers = [whole_sequence(arch, name, b) for name, b in others.items()]
    if not blocks:
        raise refuse(arch, parent, f"no block at this path has the projections {sorted(styles)} transformers' plan names")
    block = next(iter(blocks.values()))
    heads = config.num_attention_heads
    head_dim = getattr(block, "head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads
    source = inspect.getsource(type(block).forward)
    q_chunks = 2 if _gated_query(source) else 1
    projections = {roles[r] for r in ("q", "k", "v", "o")}
    head_columns = tuple(c for c, style in styles.items() if c not in projections and style == "colwise")
    for child, style in styles.items():
        if child not in projections and child not in head_columns and style != "replicated_with_grad_allreduce":
            raise refuse(arch, f"{parent}.{child}", f"transformers' style {style!r} inside attention has no plait rule")
    for leaf, style in bare.items():
        if style != "colwise":
            raise refuse(arch, f"{parent}.{leaf}", f"transformers' style {style!r} on a bare parameter of attention "
                                                   f"has no plait rule")
    layouts = {name: _head_layout(arch, parent, b, roles, config, head_dim, q_chunks, head_columns, bare)
               for name, b in blocks.items()}
    reads = {r.partition(".")[2]: q for r, q in CONFIG_READS.items() if r in source}
    local = {attr: q for attr, q in LOCAL_ATTRS.items() if isinstance(vars(block).get(attr), int)}
    common = dict(q=roles["q"], k=roles["k"], v=roles["v"], o=roles["o"], head_dim=head_dim, local_attrs=local,
                  q_chunks=q_chunks, head_columns=head_columns)
    inner = [m for b in blocks.values() for n, m in b.named_modules() if n and n not in projections and own_params(m)]
    if gathered and inner and all(p.dim() == 1 and p.shape[0] == head_dim for m in inner for p in own_params(m)):
        gathered = False  # transformers gathers q/k/v for norms that are per head (MiniMax-M3): local to a rank's heads
    if gathered:
        if len(set(layouts.values())) > 1 or q_chunks > 1 or head_columns or others:
            raise refuse(arch, parent, "full-width q/k norms beside per-layer head counts, a gated q or per-head "
                                       "gates; plait has no rule for both")
        q_heads, kv_heads, head_params = layouts[next(iter(blocks))]
        norms = _full_width_norms(arch, parent, block, roles, q_heads * head_dim, kv_heads * head_dim)
        if reads:
            raise refuse(arch, parent, f"{type(block).__name__}.forward reads {sorted(reads)} from the config beside "
                                       f"full-width q/k norms; plait has no rule for both")
        return [FullWidthNormAttention(parent, q_norm=norms[0], k_norm=norms[1], num_heads=q_heads,
                                       num_kv_heads=kv_heads, head_params=head_params, **common)]
    per_layer = bool(others) or len(set(layouts.values())) > 1
    rules: list[TPRule] = []
    for name in sorted({n for b in blocks.values() for n, m in b.named_modules() if n and own_params(m)}):
        if name in projections or name in head_columns:
            continue
        for b in blocks.values():
            module = _get(b, name)
            if module is not None and any(p.dim() != 1 or p.shape[0] != head_dim for p in own_params(module)):
                raise refuse(arch, f"{parent}.{name}", f"a replicated module inside attention whose parameters are "
                                                       f"not per head (head_dim={head_dim}); its input is split over tp")
        owners = [n for n, b in blocks.items() if _get(b, name) is not None] if per_layer else [parent]
        rules += [ReplicatedGradSum(f"{owner}.{name}") for owner in owners]
    style = LocalConfigAttention if reads else Attention
    extra = dict(config_attrs=reads) if reads else {}
    # one rule for the pattern when every layer has the same heads, else one per layer (e.g. MiMo-V2-Flash's sliding
    # layers: twice the kv heads, and sinks)
    groups = list(layouts.items()) if per_layer else [(parent, layouts[next(iter(blocks))])]
    attention = [style(pattern, num_heads=q_heads, num_kv_heads=kv_heads, head_params=head_params, **common, **extra)
                 for pattern, (q_heads, kv_heads, head_params) in groups]
    return [*attention, *rules, *mixers]


def _gated_query(source: str) -> bool:
    """Whether an attention forward reads its q projection head by head as query | gate (Qwen3-Next:
    ``torch.chunk(self.q_proj(x).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)``)."""
    return "-1, self.head_dim * 2)" in source and ("torch.chunk(" in source or ".chunk(2" in source)


def _head_layout(arch, parent, block, roles, config, head_dim: int, q_chunks: int, head_columns: tuple[str, ...],
                 bare: dict[str, str]) -> tuple[int, int, tuple[str, ...]]:
    """(q heads, kv heads, per-head bare parameters) of one attention block. Heads come from the config; where the
    projections' widths say otherwise (per-layer head counts), from the widths, but only when the block's own
    head-count attributes (``num_heads``, ``num_key_value_groups``, ...) agree with them."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    widths = {role: _out_features(_get(block, roles[role])) for role in ("q", "k", "v")}
    widths["o input"] = linear_shape(_get(block, roles["o"]))[0]
    expected = {"q": heads * head_dim * q_chunks, "k": kv_heads * head_dim, "v": kv_heads * head_dim,
                "o input": heads * head_dim}
    if widths != expected:
        q_heads, kv = widths["q"] // (head_dim * q_chunks), widths["k"] // head_dim
        layout = {"q": q_heads * head_dim * q_chunks, "k": kv * head_dim, "v": kv * head_dim, "o input": q_heads * head_dim}
        own = {attr: vars(block)[attr] for attr in LOCAL_ATTRS if isinstance(vars(block).get(attr), int)}
        counts = {"q_heads": q_heads, "kv_heads": kv, "kv_groups": q_heads // kv if kv and not q_heads % kv else None}
        if widths != layout or not own or any(counts[LOCAL_ATTRS[a]] != value for a, value in own.items()):
            raise refuse(arch, parent, f"projection widths {widths} are not heads x head_dim {expected} "
                                       f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}, "
                                       f"head_dim={head_dim}{', q | gate per head' if q_chunks > 1 else ''}), nor "
                                       f"per-layer head counts the block's attributes {own} confirm")
        heads, kv_heads = q_heads, kv
    for child in head_columns:
        width = _out_features(block.get_submodule(child))
        if width % heads:
            raise refuse(arch, f"{parent}.{child}", f"a column-parallel projection inside attention whose {width} "
                                                    f"outputs are not per q head (heads={heads})")
    params = {n: p for n, p in block._parameters.items() if p is not None}
    stray = sorted(set(params) - set(bare))
    if stray:
        raise refuse(arch, f"{parent}.{stray[0]}", "a parameter of the attention block itself that transformers' plan "
                                                   "does not split; plait cannot tell how its heads use it")
    for leaf, param in params.items():
        if tuple(param.shape) != (heads,):
            raise refuse(arch, f"{parent}.{leaf}", f"transformers shards the parameter itself ({bare[leaf]}), but its "
                                                   f"shape {tuple(param.shape)} is not one entry per q head ({heads})")
    return heads, kv_heads, tuple(params)


def _full_width_norms(arch, parent, block, roles, q_width: int, kv_width: int) -> tuple[str, str]:
    """The RMSNorms over the whole projected q and k (OLMo2's q_norm / k_norm) that make transformers gather q
    and k: plait splits them (SplitNorm, the sum of squares all-reduced). v gathered too, or anything else
    inside the block, is refused."""
    found = {}
    for name, module in block.named_modules():
        if not name or name in {roles[r] for r in ("q", "k", "v", "o")} or not own_params(module):
            continue
        params = dict(module.named_parameters())
        width = params["weight"].shape[0] if set(params) == {"weight"} and params["weight"].dim() == 1 else None
        if "RMSNorm" not in type(module).__name__ or width not in (q_width, kv_width):
            raise refuse(arch, f"{parent}.{name}", f"{type(module).__name__} inside attention whose q/k/v transformers "
                                                   f"gathers; plait splits only full-width RMSNorms on q and k")
        found[name] = width
    q_norm = next((n for n in found if "q" in n and found[n] == q_width), None)
    k_norm = next((n for n in found if "k" in n and found[n] == kv_width), None)
    if q_norm is None or k_norm is None or len(found) != 2:
        raise refuse(arch, parent, f"transformers gathers q/k/v, but the block's norms {sorted(found)} are not one "
                                   f"full-width RMSNorm each on q and k; plait has no real split for it")
    return q_norm, k_norm


def is_attention(block: nn.Module) -> bool:
    """An attention module: reshaped by heads, so splitting it needs an Attention rule, not Column / Row."""
    name = type(block).__name__
    return "Attention" in name or "Attn" in name or any(hasattr(block, a) for a in ("head_dim", "head_size"))


def _out_features(module: nn.Module) -> int:
    return module.weight.shape[1] if isinstance(module, Conv1D) else module.out_features


# --------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, ...)
# --------------------------------------------------------------------------------------------------

# The low-rank down projections and their norms, kept whole on every rank (LatentAttention's ``replicated``).
MLA_DOWN = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
# transformers' styles for the block's children, where its plan names them: what plait's split by heads agrees with.
MLA_STYLES = {"q_proj": "colwise", "q_b_proj": "colwise", "q_gate_proj": "colwise", "kv_b_proj": "colwise",
              "o_proj": "rowwise", "kv_a_proj_with_mqa": "mla_kv_a_proj"}
# How the forward reads the projections (q per head, nope | rope, kv_a as latent | shared rotary key, kv_b per
# head as k_nope | v): the layout in which a contiguous run of whole heads is a column split.
MLA_LAYOUT = ("(batch_size, seq_length, -1, self.qk_head_dim)", "[self.kv_lora_rank, self.qk_rope_head_dim]",
              "self.qk_nope_head_dim + self.v_head_dim", "[self.qk_nope_head_dim, self.v_head_dim]")


# The up projection to query heads: from the q latent, from the hidden states (no q LoRA), or fused with a per-head
# output gate, from the q latent and its normalised copy (AXK2's q_gate_proj, [q | gate] per head).
MLA_Q = ("q_b_proj", "q_gate_proj", "q_proj")
MLA_GATED_Q = "(batch_size, seq_length, -1, self.qk_head_dim + self.v_head_dim)"


def is_latent_attention(block: nn.Module) -> bool:
    """A multi-head latent attention block: a down projection to the kv latent and an up projection to heads."""
    return {"kv_a_proj_with_mqa", "kv_b_proj"} <= set(block._modules)


def _unplanned_latent_attention(model, layers: str | None, children: dict, blocks: dict, notes: list[str]) -> None:
    """Latent attention blocks transformers' plan leaves out (DeepSeek-V3, Youtu, AXK1: replicated there, which
    sequence parallelism cannot run), added to ``children`` without styles so that they are split by heads."""
    if layers is None:
        return
    for name, module in model.get_submodule(layers).named_modules(prefix=layers):
        pattern = layer_pattern(name, layers)
        if is_latent_attention(module) and pattern not in children:
            children[pattern], blocks[pattern] = {}, module
            notes.append(f"{pattern}: latent attention transformers' plan leaves replicated: split by heads")


def _latent_attention_rules(model, config, parent: str, block: nn.Module, styles: dict[str, str]) -> list[TPRule]:
    """A LatentAttention rule, once the block is the layout it splits: only the down projections and their norms,
    ``q_b_proj`` (or ``q_proj``), ``kv_b_proj``, ``o_proj`` and children computing without gradients (a sparse-attention
    indexer, replicated) hold parameters, alike in every layer the pattern matches;
    their widths are the config's heads times the block's head dims; the forward reads them per head (MLA_LAYOUT)
    and no head count from the config; transformers' styles, where its plan has them, agree (MLA_STYLES).
    In a hybrid whose other layers hold another mixer at the same path (Kimi-Linear's, Bailing-Hybrid's delta
    attention) and whose plan styles none of them, one rule per latent-attention layer; the other mixers are left to
    the rules for mixers no plan names (``undeclared_mixers``)."""
    arch = config.model_type
    hits = [(n, m) for n, m in model.named_modules() if matches(parent, n)]
    others = [n for n, m in hits if not is_latent_attention(m)]
    if others and styles:
        raise refuse(arch, parent, f"{others[0]} is a {type(model.get_submodule(others[0])).__name__}, where other "
                                   f"layers hold latent attention: layers of different kinds at one module path")
    shapes = {(n, tuple(p.shape)) for n, p in block.named_parameters()}
    unlike = [n for n, m in hits if n not in others and {(k, tuple(p.shape)) for k, p in m.named_parameters()} != shapes]
    if unlike:
        raise refuse(arch, parent, f"{unlike[0]}'s parameters differ from the other latent-attention layers'; plait has "
                                   f"no rule for it")
    q = next((c for c in MLA_Q if c in block._modules), "q_proj")
    gated_q = q == "q_gate_proj"  # [q | gate] per head, the gate multiplying the head's output (AXK2)
    down = tuple(d for d in MLA_DOWN if d in block._modules)
    # a child computing without gradients (DeepSeek-V3.2's sparse-attention indexer, @torch.no_grad): replicated on the
    # full sequence, it gives every rank the same token selection and no parameter gradient to sum
    frozen = [n for n, m in block.named_children() if n not in {q, "kv_b_proj", "o_proj", *down} and own_params_deep(m)
              and "@torch.no_grad()" in inspect.getsource(type(m).forward)]
    gates = [n for n, m in block.named_children()
             if isinstance(m, nn.Linear) and m.out_features == config.num_attention_heads and _head_gate(type(block), n)]
    known = {q, "kv_b_proj", "o_proj", *down, *frozen, *gates}
    stray = sorted(n for n, m in block.named_modules() if n and n.split(".")[0] not in known and own_params(m))
    if stray:
        raise refuse(arch, f"{parent}.{stray[0]}", "a module with parameters inside latent attention beside its "
                                                   "projections and norms; plait has no rule for it")
    differ = {child: style for child, style in styles.items() if MLA_STYLES.get(child) != style}
    if differ:
        raise refuse(arch, parent, f"transformers' styles {differ} on latent attention are not the split by heads "
                                   f"plait makes ({MLA_STYLES})")
    dims = {a: getattr(block, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")}
    if not all(isinstance(d, int) for d in dims.values()):
        raise refuse(arch, parent, f"latent attention without integer head dims {dims}")
    nope, rope, v, rank = dims.values()
    heads = config.num_attention_heads
    widths = {q: _out_features(block.get_submodule(q)), "kv_b_proj": _out_features(block.kv_b_proj),
              "kv_a_proj_with_mqa": _out_features(block.kv_a_proj_with_mqa), "o_proj input": linear_shape(block.o_proj)[0]}
    expected = {q: heads * (nope + rope + (v if gated_q else 0)), "kv_b_proj": heads * (nope + v), "kv_a_proj_with_mqa": rank + rope,
                "o_proj input": heads * v}
    if widths != expected:
        raise refuse(arch, parent, f"latent attention widths {widths} are not {expected} (num_attention_heads={heads}, "
                                   f"{dims})")
    source = "".join(inspect.getsource(getattr(type(block), f)) for f in ("forward", "expand_kv")
                     if hasattr(type(block), f))
    layout = (MLA_GATED_Q if gated_q else MLA_LAYOUT[0], *MLA_LAYOUT[1:])
    unread = [s for s in layout if s not in source] + [r for r in CONFIG_READS if r in source]
    if unread:
        raise refuse(arch, parent, f"{type(block).__name__} does not read its projections head by head as plait's split "
                                   f"assumes ({', '.join(unread)}); plait has no rule for it")
    local = tuple(a for a, q_heads in LOCAL_ATTRS.items() if q_heads == "q_heads" and isinstance(vars(block).get(a), int))
    indexers = tuple(f"{f}.{n}" for f in frozen for n, m in block.get_submodule(f).named_modules() if own_params(m))
    names = [n for n, _ in hits if n not in others] if others else [parent]
    return [LatentAttention(name, q=q, kv_b="kv_b_proj", o="o_proj", num_heads=heads, q_head_dim=nope + rope + (v if gated_q else 0),
                            kv_head_dim=nope + v, v_head_dim=v, replicated=(*down, *indexers), local_attrs=local,
                            head_columns=tuple(gates))
            for name in names]


def _head_gate(cls: type, child: str) -> bool:
    """Whether ``cls.forward`` gates each head's attention output by one value of ``child`` (Bailing-Hybrid:
    ``gate = torch.sigmoid(self.g_proj(hidden_states)...)``, ``attn_output * gate.unsqueeze(-1)`` on [b, s, heads, v])."""
    source = inspect.getsource(cls.forward)
    found = re.search(rf"(\w+) = [^\n]*self\.{child}\(hidden_states\)", source)
    return found is not None and f"attn_output * {found.group(1)}.unsqueeze(-1)" in source


# --------------------------------------------------------------------------------------------------
# Sequence parallelism
# --------------------------------------------------------------------------------------------------


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
        if _covered(name, whole):
            norms.append(pattern)
            continue
        if _covered(name, [c for c in covered if c not in routers]):
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


def _covered(name: str, patterns: list[str]) -> bool:
    """Whether module ``name`` or a block holding it matches one of the tp plan's ``patterns`` (per-layer rules
    name layers literally, so compare with concrete names, not folded patterns)."""
    parts = name.split(".")
    return any(matches(p, ".".join(parts[:i])) for p in patterns for i in range(1, len(parts) + 1))


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
    if getattr(model.config, "output_router_logits", False):
        raise refuse(arch, "output_router_logits", "the router's load-balancing loss combines the routing statistics "
                                                   "of every layer of a forward, which pipeline stages do not share; "
                                                   "set output_router_logits=False (no aux loss) or pp=1")
    _check_layer_inputs(model, arch, layers)
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


# Decoder-layer inputs every pipeline stage rebuilds itself from the full sequence (docs/decisions.md D2).
STAGE_BUILT = ("attention_mask", "position_embeddings", "position_ids", "cache_position", "past_key_values")


def _check_layer_inputs(model: nn.Module, arch: str, layers: str) -> None:
    """Pipeline stages hand on the hidden states alone. A decoder layer that needs another input the model
    threads from layer to layer (Inkling2's ``block_states``, the outputs of earlier blocks) would get, on a
    later stage, a value that never saw the earlier stage's layers: refused, not silently wrong."""
    parent = layers.rpartition(".")[0]
    source = inspect.getsource(type(model.get_submodule(parent) if parent else model).forward)
    loop = re.search(rf"for (?:\w+, )?(\w+) in (?:enumerate\()?self\.{layers.rpartition('.')[2]}\b", source)
    unpacked = loop and re.search(rf"(\w+(?:\s*,\s*\w+)+)\s*=\s*{loop.group(1)}\(", source)
    if unpacked:  # GlmMoeDsa: hidden_states, topk_indices = decoder_layer(...)
        raise refuse(arch, layers, f"each layer returns {unpacked.group(1).replace(' ', '')}, which the model hands "
                                   f"to the next layer; pipeline stages hand on only the hidden states: use pp=1")
    for cls in dict.fromkeys(type(layer) for layer in model.get_submodule(layers)):
        params = list(inspect.signature(cls.forward).parameters.values())[2:]  # self, the hidden states
        threaded = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in STAGE_BUILT
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if threaded:
            raise refuse(arch, layers, f"{cls.__name__}.forward takes {threaded} besides the hidden states, threaded "
                                       f"from layer to layer by the model; pipeline stages hand on only the hidden "
                                       f"states: use pp=1")


def own_params_deep(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())
