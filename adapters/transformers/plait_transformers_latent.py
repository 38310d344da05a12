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

from plait.patterns import matches
from plait.tp.sharding import linear_shape
from plait.tp.styles import LatentAttention, TPRule

from plait_transformers_common import (
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


def latent_attention_rules(model, config, parent: str, block: nn.Module, styles: dict[str, str]) -> list[TPRule]:
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
    indexers = tuple(f"{f}.{n}" for f in frozen for n, m in block.get_submodule(f).named_modules() if own_params(m))
    names = [n for n, _ in hits if n not in others] if others else [parent]
    return [LatentAttention(name, q=q, kv_b="kv_b_proj", o="o_proj", num_heads=heads,
                            q_head_dim=nope + rope + (v if gated_q else 0),
                            kv_head_dim=nope + v, v_head_dim=v, replicated=(*down, *indexers), local_attrs=local,
                            head_columns=tuple(gates))
            for name in names]


def _head_gate(cls: type, child: str) -> bool:
    """Whether ``cls.forward`` gates each head's attention output by one value of ``child`` (Bailing-Hybrid:
    ``gate = torch.sigmoid(self.g_proj(hidden_states)...)``, ``attn_output * gate.unsqueeze(-1)`` on [b, s, heads, v])."""
    source = inspect.getsource(cls.forward)
    found = re.search(rf"(\w+) = [^\n]*self\.{child}\(hidden_states\)", source)
    return found is not None and f"attn_output * {found.group(1)}.unsqueeze(-1)" in source
