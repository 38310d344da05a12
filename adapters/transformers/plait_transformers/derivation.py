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

This module walks transformers' tp plan and holds the model-wide rules (embedding and head, MoE blocks); the
rules for one block are in blocks (attention in attention, latent attention in latent, MLPs in mlp), the SP
region in sp_region and the pipeline stages in pipeline_stages (what both read of the forward in forward_flow),
and what they all share in common.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from plait import Column, PipelinePlan, Row, SPPlan, TPPlan, VocabEmbedding, VocabHead
from plait.base.meta import build_meta_model
from plait.base.patterns import matches
from plait.tp.styles import ExpertMajorExperts, MoEExperts, MoERouter, ScaledVocabEmbedding, TPRule

from plait_transformers.attention import undeclared_attention
from plait_transformers.blocks import block_rules, bare_refusal, undeclared_mixers
from plait_transformers.common import (
    LINEAR_STYLES, LM_HEAD_STYLES, LOCAL_PARAMS, MOE_STYLES, is_attention, is_linear, layer_container,
    layer_pattern, own_params, own_params_deep, Refusal, refuse,
)
from plait_transformers.latent import unplanned_latent_attention
from plait_transformers.pipeline_stages import pipeline_plan
from plait_transformers.sp_region import norms_after_loop, sp_plan
from plait_transformers.structure import structural_tp_plan


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
    sp = _attempt(arch, lambda: _checked_end(model, arch, layers,
                                             _one_stream(config, sp_plan(model, arch, layers, tp))))
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


def _checked_end(model: nn.Module, arch: str, layers: str, sp: SPPlan) -> SPPlan:
    """``sp``, unless it ends at the last layer while a norm with parameters beside the layer list runs after the
    layers (OPTDecoder registers its ``final_layer_norm`` before its layers and runs it after them): that norm would
    run outside the region on the gathered sequence, where a vocab-parallel head hands it one vocab shard's
    gradient, not summed over tp."""
    norms = [name for name in norms_after_loop(model, layers) if own_params_deep(model.get_submodule(name))]
    if sp.end == f"{layers}.{len(model.get_submodule(layers)) - 1}" and norms:
        raise refuse(arch, norms[0], f"a norm beside the layers that the sequence-parallel region does not end at (it "
                                     f"ends at {sp.end}); its gradient would come from one vocab shard only: disable "
                                     f"sequence parallelism")
    return sp


def _one_stream(config, sp: SPPlan) -> SPPlan:
    """``sp``, unless the decoder layers pass hyper-connection residual streams (``hc_mult`` > 1: HY-V4, DeepSeek-V4),
    hidden states [batch, sequence, streams, hidden]: sequence parallelism splits the dimension before hidden, which
    there is the streams, not the sequence."""
    streams = getattr(config.get_text_config(), "hc_mult", 1)
    if isinstance(streams, int) and streams > 1:
        raise refuse(config.model_type, sp.begin, f"the decoder layers pass {streams} hyper-connection streams "
                                                  f"(hc_mult), hidden states [batch, sequence, streams, hidden]; "
                                                  f"sequence parallelism splits the dimension before hidden, the "
                                                  f"streams: disable sequence parallelism")
    return sp


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: " + " ".join(str(err).split())


def tp_plan(model: nn.Module, config, layers: str | None, notes: list[str]) -> TPPlan:
    """transformers' tp plan as plait rules: attention blocks, Column / Row linears, per-head norms, the
    vocab-parallel embedding and head; a style plait cannot honour is a Refusal naming it."""
    arch = config.model_type
    text = config.get_text_config()  # a composite's (Llama4, Gemma4) head counts are its text config's
    declared = dict(model.tp_plan or {})
    if not declared:
        declared = structural_tp_plan(model, layers)
        notes.append("transformers declares no tp plan: the styles it declares for the same structures elsewhere, "
                     "read from the module tree")
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
        holder = example[pattern].rpartition(".")[0]
        if _wraps_one_linear(model.get_submodule(holder)):  # Gemma 4's q_proj.linear: q_proj is the projection
            parent, _, wrapper = parent.rpartition(".")
            child, holder = f"{wrapper}.{child}", holder.rpartition(".")[0]
        children[parent][child] = style
        blocks.setdefault(parent, model.get_submodule(holder))
    unplanned_latent_attention(model, layers, children, blocks, notes)
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
            rules += _moe_rules(model, text, parent, styles, experts)
        else:
            rules += block_rules(model, text, parent, blocks[parent], styles, bare.pop(parent, {}))
    for parent, params in bare.items():
        raise bare_refusal(arch, parent, params)
    rules += undeclared_mixers(model, arch, layers, rules, notes)
    return TPPlan(tuple(rules))


def _wraps_one_linear(module: nn.Module) -> bool:
    """Whether ``module`` only wraps one linear layer: no parameters of its own, that one child holding them all
    (Gemma 4's ``Gemma4ClippableLinear``, which clamps the inputs and outputs of its ``linear``)."""
    holding = [child for child in module.children() if own_params_deep(child)]
    return not own_params(module) and len(holding) == 1 and is_linear(holding[0])


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
    shared_bias = head_name is not None and _names_of(model, getattr(out, "bias", None)) > 1
    before = _before_head(model, emb, out)
    if head_name and styled.get(head_name) in LM_HEAD_STYLES and is_linear(out) and (embedding or not tied) \
            and not shared_bias and not before:
        head = [VocabHead(head_name)]
    elif head_name:
        why = f" ({before[0]} runs before it, outside the decoder, and would see its split gradient)" if before \
            else " (its bias is also its parent's)" if shared_bias else " (tied to a replicated embedding)" if tied \
            else ""
        notes.append(f"{head_name} kept replicated{why}")
    if tied and embedding and not head:
        notes.append(f"{emb_name} kept replicated (tied to the replicated head)")
        embedding = []
    return embedding, head


def _before_head(model: nn.Module, embedding: nn.Module, head: nn.Module | None) -> list[str]:
    """The model's own children with parameters besides its decoder (the child holding the input embedding) and the
    LM head (ModernBERT's prediction head, dense and norm between the final norm and the head): replicated, their
    gradients would be one vocab shard's under a vocab-parallel head, which only the decoder's own region end sums."""
    return [n for n, m in model.named_children() if any(True for _ in m.parameters())
            and not any(x is head or x is embedding for x in m.modules())]


def _names_of(model: nn.Module, param: nn.Parameter | None) -> int:
    """Under how many names ``param`` is registered: BERT-style heads register the decoder's bias on the head
    block too, where a vocab-parallel split of the decoder would leave the second name whole."""
    return sum(1 for _, p in model.named_parameters(remove_duplicate=False) if param is not None and p is param)
