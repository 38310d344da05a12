"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, ...): the rule that splits it by heads.

The up projections to heads (``q_b_proj``, or ``q_proj`` without a q LoRA, or a query fused with a per-head
gate) and ``kv_b_proj`` are column-parallel by whole heads, ``o_proj`` row-parallel; the low-rank down
projections and their norms stay whole on every rank with their gradients summed over tp (LatentAttention).
The forward's source must show the per-head layout in which a contiguous run of heads is a column split.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

from plait.base.patterns import matches
from plait.tp.sharding import linear_shape
from plait.tp.styles import LatentAttention, TPRule

from plait_transformers.common import (
    CONFIG_READS, LOCAL_ATTRS, out_features, layer_pattern, own_params, own_params_deep, refuse,
)


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


REPLICATED_GRAD = "replicated_with_grad_allreduce"  # transformers' style: whole on every rank, gradient all-reduced


def is_latent_attention(block: nn.Module) -> bool:
    """A multi-head latent attention block: a down projection to the kv latent and an up projection to heads."""
    return {"kv_a_proj_with_mqa", "kv_b_proj"} <= set(block._modules)


def unplanned_latent_attention(model, layers: str | None, children: dict, blocks: dict, notes: list[str]) -> None:
    """Latent attention blocks transformers' plan leaves out (DeepSeek-V3, Youtu, AXK1: replicated there, which
    sequence parallelism cannot run), added to ``children`` without styles so that they are split by heads."""
    if layers is None:
        return
    for name, module in model.get_submodule(layers).named_modules(prefix=layers):
        pattern = layer_pattern(name, layers)
        if is_latent_attention(module) and pattern not in children:
            children[pattern], blocks[pattern] = {}, module
            notes.append(f"{pattern}: latent attention transformers' plan leaves replicated: split by heads")


def latent_attention_rules(model, config, parent: str, block: nn.Module, styles: dict[str, str],
                           bare: dict[str, str] | None = None) -> list[TPRule]:
    """A LatentAttention rule, once the block is the layout it splits: only the down projections and their norms,
    ``q_b_proj`` (or ``q_proj``), ``kv_b_proj``, ``o_proj``, per-head output gates, children transformers' plan keeps
    replicated with their gradients all-reduced, and children computing without gradients (a sparse-attention
    indexer, replicated) hold parameters, alike in every layer the pattern matches but for those last; the block's
    own parameters are per-head sinks its plan shards (``bare``); the widths are the config's heads times the
    block's head dims; the forward reads them per head (MLA_LAYOUT) and no head count from the config;
    transformers' styles, where its plan has them, agree (MLA_STYLES).
    In a hybrid whose other layers hold another mixer at the same path (Kimi-Linear's, Bailing-Hybrid's delta
    attention) and whose plan styles none of them, and where only some layers hold an indexer (HY-V4, Dots3:
    the others reuse the last one's selection or have none), one rule per latent-attention layer; the other
    mixers are left to the rules for mixers no plan names (``undeclared_mixers``)."""
    arch = config.model_type
    hits = [(n, m) for n, m in model.named_modules() if matches(parent, n)]
    others = [n for n, m in hits if not is_latent_attention(m)]
    if others and styles:
        raise refuse(arch, parent, f"{others[0]} is a {type(model.get_submodule(others[0])).__name__}, where other "
                                   f"layers hold latent attention: layers of different kinds at one module path")
    latent = {n: m for n, m in hits if n not in others}
    frozen = {n: _frozen_children(m) for n, m in latent.items()}
    shapes = {n: {(k, tuple(p.shape)) for k, p in m.named_parameters() if k.split(".")[0] not in frozen[n]}
              for n, m in latent.items()}
    unlike = [n for n in latent if shapes[n] != shapes[next(iter(latent))]]
    if unlike:
        raise refuse(arch, parent, f"{unlike[0]}'s parameters differ from the other latent-attention layers'; plait has "
                                   f"no rule for it")
    q = next((c for c in MLA_Q if c in block._modules), "q_proj")
    gated_q = q == "q_gate_proj"  # [q | gate] per head, the gate multiplying the head's output (AXK2)
    down = tuple(d for d in MLA_DOWN if d in block._modules)
    heads = config.num_attention_heads
    gates = _head_gates(block, heads)
    # declared replicated with the gradient all-reduced (Dots3's k_rope_only_layernorm on the shared rotary key): on
    # the full sequence like the down projections, feeding this rank's heads only
    summed = tuple(c for c, style in styles.items() if style == REPLICATED_GRAD and c in block._modules)
    known = {q, "kv_b_proj", "o_proj", *down, *summed, *_frozen_children(block), *gates}
    stray = sorted(n for n, m in block.named_modules() if n and n.split(".")[0] not in known and own_params(m))
    if stray:
        raise refuse(arch, f"{parent}.{stray[0]}", "a module with parameters inside latent attention beside its "
                                                   "projections and norms; plait has no rule for it")
    allowed = {**MLA_STYLES, **{g: "colwise" for g in gates}, **{c: REPLICATED_GRAD for c in summed}}
    differ = {child: style for child, style in styles.items() if allowed.get(child) != style}
    if differ:
        raise refuse(arch, parent, f"transformers' styles {differ} on latent attention are not the split by heads "
                                   f"plait makes ({allowed})")
    sinks = _sinks(arch, parent, block, bare or {}, heads)
    dims = {a: getattr(block, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")}
    if not all(isinstance(d, int) for d in dims.values()):
        raise refuse(arch, parent, f"latent attention without integer head dims {dims}")
    nope, rope, v, rank = dims.values()
    widths = {q: out_features(block.get_submodule(q)), "kv_b_proj": out_features(block.kv_b_proj),
              "kv_a_proj_with_mqa": out_features(block.kv_a_proj_with_mqa), "o_proj input": linear_shape(block.o_proj)[0]}
    expected = {q: heads * (nope + rope + (v if gated_q else 0)), "kv_b_proj": heads * (nope + v),
                "kv_a_proj_with_mqa": rank + rope,
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
    per_layer = bool(others) or len({tuple(f) for f in frozen.values()}) > 1
    blocks = latent if per_layer else {parent: block}
    return [LatentAttention(name, q=q, kv_b="kv_b_proj", o="o_proj", num_heads=heads,
                            q_head_dim=nope + rope + (v if gated_q else 0), kv_head_dim=nope + v, v_head_dim=v,
                            replicated=(*down, *summed, *_indexer_modules(b)), local_attrs=local,
                            head_columns=gates, head_params=sinks)
            for name, b in blocks.items()]


def _frozen_children(block: nn.Module) -> list[str]:
    """Children with parameters that compute without gradients (DeepSeek-V3.2's sparse-attention indexer,
    ``@torch.no_grad()``): replicated on the full sequence, they give every rank the same token selection and no
    parameter gradient to sum."""
    return [n for n, m in block.named_children() if own_params_deep(m) and n not in MLA_DOWN
            and "@torch.no_grad()" in inspect.getsource(type(m).forward)]


def _indexer_modules(block: nn.Module) -> tuple[str, ...]:
    """The modules with parameters of ``block``'s frozen children, as LatentAttention's ``replicated`` names them."""
    return tuple(f"{f}.{n}" for f in _frozen_children(block) for n, m in block.get_submodule(f).named_modules()
                 if own_params(m))


def _sinks(arch: str, parent: str, block: nn.Module, bare: dict[str, str], heads: int) -> tuple[str, ...]:
    """The block's own parameters, each one attention-sink logit per head that transformers' plan shards with the
    heads (HY-V4's ``sinks``, passed as the attention functions' ``s_aux``); any other parameter of the block itself
    is refused: plait cannot tell how its heads use it."""
    source = inspect.getsource(type(block).forward)
    for leaf, param in block._parameters.items():
        if param is None:
            continue
        if bare.get(leaf) != "colwise" or f"s_aux=self.{leaf}," not in source or tuple(param.shape) != (heads,):
            raise refuse(arch, f"{parent}.{leaf}", f"a parameter of latent attention itself (shape "
                                                   f"{tuple(param.shape)}, style {bare.get(leaf)!r}) that is not an "
                                                   f"attention sink per head ({heads}) its plan shards colwise; plait "
                                                   f"has no rule for it")
    return tuple(leaf for leaf, param in block._parameters.items() if param is not None)


def _head_gates(block: nn.Module, heads: int) -> tuple[str, ...]:
    """Linear children gating each head's attention output (``_head_gate``) by one value per head or one per feature
    of the head's value (``v_head_dim``): elementwise per head, so split with the heads."""
    per_head = {heads: 1, heads * getattr(block, "v_head_dim", 0): getattr(block, "v_head_dim", 0)}
    return tuple(n for n, m in block.named_children()
                 if isinstance(m, nn.Linear) and m.out_features in per_head and
                 _head_gate(block, n, per_head[m.out_features]))


def _head_gate(block: nn.Module, child: str, per_head: int) -> bool:
    """Whether ``block``'s forward multiplies its attention output, [b, s, heads, v] until reshaped for ``o_proj``,
    by ``child``'s projection of the hidden states viewed as ``per_head`` values per head: ``attn_output *
    gate.unsqueeze(-1)`` of one value per head (Bailing-Hybrid: ``gate = torch.sigmoid(self.g_proj(hidden_states)
    ...)``), or the sigmoid of ``self.<child>(hidden_states).view(batch_size, seq_length, -1, W)`` where W is the
    number or block attribute ``per_head`` (Dots3: ``view(..., -1, 1)``, ``attn_output * gate.sigmoid()``; HY-V4:
    ``view(..., -1, self.gate_projection_size)`` = v_head_dim, ``attn_output * torch.sigmoid(gate_states)``)."""
    source = inspect.getsource(type(block).forward)
    read = re.search(rf"(\w+) = [^\n]*self\.{child}\(hidden_states\)([^\n]*)", source)
    reshaped = source.find("attn_output = attn_output.reshape(batch_size, seq_length, -1)")
    if read is None or reshaped < read.end():
        return False
    gate, rest = read.groups()
    if per_head == 1 and f"attn_output * {gate}.unsqueeze(-1)" in source:
        return True
    view = re.match(r"\.view\(batch_size, seq_length, -1, (\d+|self\.\w+)\)$", rest.strip())
    size = view and (int(view.group(1)) if view.group(1).isdigit() else getattr(block, view.group(1)[5:], None))
    applied = f"attn_output * torch.sigmoid({gate})" in source or f"attn_output * {gate}.sigmoid()" in source
    return size == per_head and applied
