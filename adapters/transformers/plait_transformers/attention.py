"""Tensor-parallel rules for attention blocks: separate q/k/v projections (with per-head and full-width q/k norms,
per-head output gates and sinks, heads paired or counted per layer), a fused qkv in the two layouts transformers'
models use, and attention blocks transformers' plan leaves out but the model's structure shows
(``undeclared_attention``). Each splits the block by whole heads, as the forward's source shows it reads them; a
layout it cannot read is refused.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

from transformers.pytorch_utils import Conv1D

from plait import Attention
from plait.base.patterns import matches
from plait.tp.sharding import linear_shape
from plait.tp.styles import (
    FullWidthNormAttention, HeadInterleavedAttention, LocalConfigAttention, PairedHeadsAttention, ReplicatedGradSum,
    SplitNorm, TPRule,
)

from plait_transformers.common import (
    CONFIG_READS, GATHERED, K, LOCAL_ATTRS, O, Q, QKV, V, get_module, head_biases, is_attention,
    is_softmax_attention, layer_pattern, out_features, own_params, refuse, whole_sequence,
)
from plait_transformers.mlp import split_sub_norm


def undeclared_attention(model: nn.Module, layers: str | None,
                         children: dict[str, dict[str, str]]) -> dict[str, tuple[nn.Module, dict[str, str], dict[str, str]]]:
    """Attention blocks in the decoder layers that transformers' plan leaves out (granitemoe's and phimoe's
    declare only the experts), found by inspecting the model: a block calling transformers' attention functions
    with separate Linear q, k, v and o projections and no styled child gets the styles transformers declares
    for such blocks elsewhere (q/k/v colwise, o rowwise); ``attention_rules`` checks its widths and heads as for
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
        roles = {role: next((p for c in names if (p := _linear_path(module, c))), None)
                 for role, names in (("q", Q), ("k", K), ("v", V), ("o", O))}
        source = inspect.getsource(type(module).forward)
        fused = next((c for c in QKV if isinstance(module._modules.get(c), (nn.Linear, Conv1D))), None)
        own_scores = head_biases(module) or re.search(SPLIT_BY_SIZE, source)
        widths = _fused_widths(module, model.config, module._modules[roles["o"]]) if fused and roles["o"] else ()
        if roles["q"] is None and fused and ("ALL_ATTENTION_FUNCTIONS" in source or own_scores) and \
                out_features(module._modules[fused]) in widths:
            # attention with one fused q/k/v projection (Persimmon's query_key_value; GPT-BigCode's and Falcon's
            # multi-query ones: q heads | one k | one v head), or computing its scores itself with an ALiBi bias per
            # head (Bloom, MPT; the bias sliced to each rank's heads) or from a q | k | v split by width (OpenAI GPT's
            # Conv1D c_attn): its layout is checked as a declared one's
            found[pattern] = (module, {fused: "colwise", roles["o"]: "rowwise"}, {})
            continue
        if None in roles.values() or "ALL_ATTENTION_FUNCTIONS" not in source:
            continue
        _check_one_input(model, name, pattern, module, [roles[r] for r in ("q", "k", "v")])
        styles = {roles[r]: "colwise" for r in ("q", "k", "v")}
        gates = {c: "colwise" for c in _output_gates(module, source, set(roles.values()))}
        sinks = {leaf: "colwise" for leaf in module._parameters if f"s_aux=self.{leaf}," in source}
        found[pattern] = (module, {**styles, **gates, roles["o"]: "rowwise"}, sinks)
    return found


def _fused_kv_heads(block: nn.Module, config, heads: int) -> int:
    """The kv heads of an attention block with a fused qkv: the block's own count where it keeps one (GPT-BigCode's
    ``kv_heads``, Falcon's ``num_kv_heads``: 1 under multi-query attention), else the config's, else ``heads``."""
    own = next((v for a in ("kv_heads", "num_kv_heads", "num_key_value_heads")
                if isinstance(v := vars(block).get(a), int)), None)
    return own or getattr(config, "num_key_value_heads", None) or heads


def _fused_widths(block: nn.Module, config, o: nn.Module) -> tuple[int, ...]:
    """The output widths of a fused q | k | v projection before ``o`` (a Linear or Conv1D): three times o's input
    (as many kv heads as q heads), or o's input and two kv heads' widths (multi-query or grouped kv heads, counted by
    the block)."""
    width = o.weight.shape[0] if isinstance(o, Conv1D) else o.in_features
    heads = next((v for a in ("num_heads", "n_heads", "n_head") if isinstance(v := vars(block).get(a), int)), None)
    if heads is None or width % heads:
        return (3 * width,)
    kv_width = _fused_kv_heads(block, config, heads) * (width // heads)
    return 3 * width, width + 2 * kv_width


SPLIT_BY_SIZE = r"\.split\(self\.split_size, dim=2\)"
# How a forward splits its fused output into q | k | v by the block's own widths (a regular expression over its
# source), and which of the block's attributes hold those widths (set to this rank's); each applies only where the
# block's ``multi_query`` attribute, if it has one, is True (its other branch lays the heads out otherwise).
WIDTH_SPLITS = (
    # GPT-BigCode: .split((self.embed_dim, self.kv_dim, self.kv_dim), dim=3); one kv head
    (r"\.split\(\(self\.embed_dim, self\.kv_dim, self\.kv_dim\), dim=3\)",
     {"embed_dim": "q_width", "kv_dim": "kv_width", "kv_heads": "kv_heads"}),
    # OpenAI GPT: query, key, value = x.split(self.split_size, dim=2), then split_heads by self.n_head
    (SPLIT_BY_SIZE, {"split_size": "q_width", "n_head": "q_heads"}),
    # DBRX: qkv_states.split([self.hidden_size, self.num_key_value_heads * self.head_dim, (again)], dim=2)
    (r"\.split\(\s*\[\s*self\.hidden_size,\s*self\.num_key_value_heads \* self\.head_dim,"
     r"\s*self\.num_key_value_heads \* self\.head_dim,?\s*\],\s*dim=2", {"hidden_size": "q_width"}),
)


def _q_then_kv(block: nn.Module, source: str, kv_heads: int) -> dict[str, str] | None:
    """The width attributes (``Attention.local_attrs``) of a block whose forward reads its fused qkv as q heads | k
    heads | v heads side by side by its own widths or head count (``WIDTH_SPLITS``; Falcon's multi-query
    ``view(..., self.num_heads + 2, self.head_dim)``, then ``[..., :-2, :]`` for q, before its new decoder
    architecture), else None."""
    if vars(block).get("multi_query") is False or vars(block).get("new_decoder_architecture"):
        return None
    found = next((attrs for pattern, attrs in WIDTH_SPLITS if re.search(pattern, source)), None)
    if found is not None:
        return {attr: q for attr, q in found.items() if isinstance(vars(block).get(attr), int)}
    whole = inspect.getsource(type(block))
    falcon = "self.num_heads + 2, self.head_dim)" in whole and "[..., :-2, :]" in whole
    return {} if falcon and kv_heads == 1 and vars(block).get("multi_query") is True else None


def _linear_path(block: nn.Module, child: str) -> str | None:
    """``child`` where it is a Linear (or transformers' Conv1D: OpenAI GPT's c_proj); ``child.<inner>`` where it wraps
    one Linear, holding nothing else, and its forward returns that Linear of its first argument (Moshi's MoshiLinear:
    ``return self.linear(x)``), so that the wrapper adds nothing to split; else None."""
    module = block._modules.get(child)
    if isinstance(module, (nn.Linear, Conv1D)):
        return child
    children = dict(module.named_children()) if module is not None else {}
    if len(children) != 1 or own_params(module) or not isinstance(next(iter(children.values())), nn.Linear):
        return None
    inner = next(iter(children))
    first = next(iter(inspect.signature(module.forward).parameters), None)
    return f"{child}.{inner}" if f"return self.{inner}({first})" in inspect.getsource(type(module).forward) else None


def _check_one_input(model: nn.Module, name: str, pattern: str, block: nn.Module, projections: list[str]) -> None:
    """Refuse an attention block whose q/k/v projections read forward arguments besides its first unless its decoder
    layer passes one variable for all of them (CTRL: ``forward(self, v, k, q)``, called as ``attn(normed, normed,
    normed)``): the tensor-parallel region enters the first argument, and the same tensor wherever it is passed
    again, but leaves any other tensor on its sequence shard."""
    source = inspect.getsource(type(block).forward)
    params = list(inspect.signature(block.forward).parameters)
    read = {m.group(1) for p in projections for m in [re.search(rf"self\.{p.partition('.')[0]}\((\w+)[,)]", source)] if m}
    others = sorted(read & set(params) - set(params[:1]))
    if not others:
        return
    parent, _, child = name.rpartition(".")
    call = re.search(rf"self\.{child}\(([^()]*)", inspect.getsource(type(model.get_submodule(parent)).forward))
    passed = [a.strip() for a in call.group(1).split(",")] if call else []
    wanted = [params.index(p) for p in [params[0], *others]]
    if len(passed) <= max(wanted) or len({passed[i] for i in wanted}) != 1 or "=" in passed[max(wanted)]:
        raise refuse(model.config.model_type, pattern, f"its projections read the forward arguments "
                                                       f"{[params[0], *others]}, which its decoder layer does not pass "
                                                       f"as one tensor; the tensor-parallel region enters only that one")


def _output_gates(block: nn.Module, source: str, projections: set[str]) -> list[str]:
    """Linear children of an attention block whose output, read from the block's input, multiplies the attention
    output through a sigmoid (AFMoE: ``gate_states = self.gate_proj(hidden_states)`` ...
    ``output * torch.sigmoid(gate_states)``; LFM3: ``attn_output * torch.sigmoid(self.g_proj(hidden_states))
    .unsqueeze(-1)``, one gate per head): elementwise per head, so split with the q heads."""
    gates = []
    for child, module in block.named_children():
        if child in projections or not isinstance(module, nn.Linear):
            continue
        read = re.search(rf"(\w+) = self\.{child}\(hidden_states\)", source)
        if read and f"* torch.sigmoid({read.group(1)}" in source or \
                f"* torch.sigmoid(self.{child}(hidden_states))" in source:
            gates.append(child)
    return gates


def fused_attention_rules(config, parent, block, styles, qkv: str, o: str) -> list[TPRule]:
    """Attention with one fused q/k/v projection, in one of the layouts transformers' models use, read from
    the forward's source: q | k | v side by side, sliced at ``num_attention_heads * head_dim`` (Phi3
    ``qkv_proj``; LocalConfigAttention gives the block a config holding this rank's head counts), or head by
    head, viewed as (heads, 3 * head_dim) and chunked in three (GPT-NeoX ``query_key_value``;
    HeadInterleavedAttention), or in model-parallel chunks of several heads (CodeGen, ``_qkv_groups``). Any other
    layout is refused."""
    arch = config.model_type
    if GATHERED.get(styles[o], styles[o]) != "rowwise" or GATHERED.get(styles[qkv], styles[qkv]) != "colwise":
        raise refuse(arch, parent, f"fused attention styles {styles} are not column-parallel qkv and row-parallel out")
    heads = config.num_attention_heads
    kv_heads = _fused_kv_heads(block, config, heads)
    head_dim = getattr(block, "head_dim", None) or getattr(block, "head_size", None) or \
        getattr(config, "head_dim", None) or config.hidden_size // heads
    stray = [n for n, m in block.named_modules() if n and n not in (qkv, o) and own_params(m)]
    # per-head q/k norms (Persimmon's q_layernorm over head_dim) work on a rank's own heads: their gradients summed
    per_head = [n for n in stray if all(p.dim() == 1 and p.shape[0] == head_dim for p in own_params(block.get_submodule(n)))]
    if set(stray) - set(per_head) or len(styles) != 2:
        raise refuse(arch, f"{parent}.{(sorted(set(stray) - set(per_head)) or sorted(set(styles) - {qkv, o}))[0]}",
                     "a module inside fused attention beside qkv and out; plait has no rule for it")
    norms = [ReplicatedGradSum(f"{parent}.{n}") for n in per_head]
    width = out_features(block.get_submodule(qkv))
    if width != (heads + 2 * kv_heads) * head_dim:
        raise refuse(arch, f"{parent}.{qkv}", f"fused width {width} is not (heads + 2 kv heads) x head_dim = "
                                              f"({heads} + 2 x {kv_heads}) x {head_dim}")
    source = inspect.getsource(type(block).forward)
    local = {attr: q for attr, q in LOCAL_ATTRS.items() if isinstance(vars(block).get(attr), int)}
    common = dict(qkv=qkv, o=o, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, local_attrs=local,
                  head_inputs=head_biases(block))
    # Persimmon's and Bloom's _split_heads / _reshape (heads, 3, head_dim): the same
    interleaved = ".chunk(3" in source and ("3 * self.head_size" in source or "3 * self.head_dim" in source) or \
        "self.num_heads, 3, self.head_dim)" in inspect.getsource(type(block))
    if interleaved and kv_heads == heads:
        return [HeadInterleavedAttention(parent, **common), *norms]
    if _thirds(source, qkv) and kv_heads == heads and not interleaved:
        return [Attention(parent, **common), *norms]
    widths = _q_then_kv(block, source, kv_heads)
    if widths is not None:  # q heads split; kv heads too, or replicated (a multi-query block's one) when fewer than tp
        return [Attention(parent, **{**common, "local_attrs": {**local, **widths}}), *norms]
    groups = _qkv_groups(block, source)
    if groups and kv_heads == heads and not interleaved:
        return [HeadInterleavedAttention(parent, groups=groups, **common), *norms]
    sliced = "config.num_attention_heads * self.head_dim" in source
    if sliced and not interleaved:
        reads = {r.partition(".")[2]: q for r, q in CONFIG_READS.items() if r in source}
        return [LocalConfigAttention(parent, config_attrs=reads, **common), *norms]
    raise refuse(arch, f"{parent}.{qkv}", f"{type(block).__name__}.forward splits its fused qkv in a layout plait does "
                                          f"not recognise (neither q|k|v sliced by head counts nor per-head "
                                          f"interleaved)")


def _thirds(source: str, qkv: str) -> bool:
    """Whether a forward chunks its fused qkv output in three, q | k | v side by side, each viewed by the block's own
    head count (MPT: ``mixed_qkv = self.Wqkv(hidden_states)``, ``mixed_qkv.chunk(3, dim=2)``, ``reshape(batch_size,
    seq_length, self.n_heads, self.head_dim)``): Attention's fused layout, the head counts per rank."""
    read = re.search(rf"(\w+) = self\.{qkv}\(hidden_states\)", source)
    if read is None or not re.search(rf"= {read.group(1)}\.chunk\(3, dim=(2|-1)\)", source):
        return False
    return re.search(r"\.(reshape|view)\([^()]*self\.(n_heads|num_heads), self\.head_dim\)", source) is not None


def _qkv_groups(block: nn.Module, source: str) -> int | None:
    """The number of [q | v | k] chunks of a fused qkv laid out in model-parallel groups (CodeGen: ``local_dim =
    self.embed_dim // self.mp_num``, the output viewed as ``(*input_shape, -1, 3 * local_dim)``), else None. Each
    chunk holds q, k and v of heads / mp_num heads; the view's -1 takes however many chunks a rank holds."""
    mp_num = vars(block).get("mp_num")
    laid_out = "local_dim = self.embed_dim // self.mp_num" in source and "(*input_shape, -1, 3 * local_dim)" in source
    return mp_num if laid_out and isinstance(mp_num, int) else None


def attention_rules(model, config, parent, styles, roles, bare) -> list[TPRule]:
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
    blocks = {name: b for name, b in matched.items() if all(get_module(b, roles[r]) is not None for r in ("q", "k", "v", "o"))}
    # other layers' blocks at this path without these projections: a linear attention (MiniMax's lightning
    # attention) is kept whole on every rank and run on the whole sequence; anything else is refused
    others = {name: b for name, b in matched.items() if name not in blocks}
    kinds = {type(b) for b in blocks.values()}
    if len(kinds) > 1:
        raise refuse(arch, parent, f"attention blocks of different classes {sorted(k.__name__ for k in kinds)} "
                                   f"at one module path, which plait's patterns cannot tell apart")
    lacking = next((name for name, b in others.items() if is_softmax_attention(b)), None)
    if lacking is not None:
        missing = sorted(roles[r] for r in ("q", "k", "v", "o") if get_module(matched[lacking], roles[r]) is None)
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
            raise refuse(arch, f"{parent}.{child}", f"transformers' style {style!r} inside attention has no plait rule"
                                                    f"{ROW_INSIDE if style == 'rowwise' else ''}")
    for leaf, style in bare.items():
        if style != "colwise":
            raise refuse(arch, f"{parent}.{leaf}", f"transformers' style {style!r} on a bare parameter of attention "
                                                   f"has no plait rule")
    reads = {r.partition(".")[2]: q for r, q in CONFIG_READS.items() if r in source}
    local = {attr: q for attr, q in LOCAL_ATTRS.items() if isinstance(vars(block).get(attr), int)}
    if paired_heads(source):
        extras = {"other blocks": sorted(others), "gates": head_columns, "sharded parameters": sorted(bare),
                  "config reads": sorted(reads), "gathered q/k/v": gathered, "gated q": q_chunks > 1}
        return [_paired_attention(arch, parent, blocks, roles, config, head_dim, local, extras)]
    layouts = {name: _head_layout(arch, parent, b, roles, config, head_dim, q_chunks, head_columns, bare)
               for name, b in blocks.items()}
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
        if not per_layer and split_sub_norm(block, name, roles["o"]):
            rules.append(SplitNorm(f"{parent}.{name}"))  # over all heads' outputs, before the row-parallel o
            continue
        for b in blocks.values():
            module = get_module(b, name)
            if module is not None and any(p.dim() != 1 or p.shape[0] != head_dim for p in own_params(module)):
                raise refuse(arch, f"{parent}.{name}", f"a replicated module inside attention whose parameters are "
                                                       f"not per head (head_dim={head_dim}); its input is split over tp")
        owners = [n for n, b in blocks.items() if get_module(b, name) is not None] if per_layer else [parent]
        rules += [ReplicatedGradSum(f"{owner}.{name}") for owner in owners]
    style = LocalConfigAttention if reads else Attention
    extra = dict(config_attrs=reads) if reads else {}
    # one rule for the pattern when every layer has the same heads, else one per layer (e.g. MiMo-V2-Flash's sliding
    # layers: twice the kv heads, and sinks)
    groups = list(layouts.items()) if per_layer else [(parent, layouts[next(iter(blocks))])]
    attention = [style(pattern, num_heads=q_heads, num_kv_heads=kv_heads, head_params=head_params, **common, **extra)
                 for pattern, (q_heads, kv_heads, head_params) in groups]
    return [*attention, *rules, *mixers]


# Why a row-parallel projection inside attention beside its output projection is refused (Doge's dt_proj, all kv
# heads' values -> one value per kv head, which its forward turns into each kv head's attention mask).
ROW_INSIDE = (" beside the output projection: a row split sums it over tp into every head's outputs on every rank, "
              "while each rank's attention holds its own heads; use tp=1 or write an adapter (`plait plan "
              "--show-derived` starts one)")


def paired_heads(source: str) -> bool:
    """Whether an attention forward pairs q head h with head h + H/2 (DiffLlama: ``torch.chunk(value_states, 2,
    dim=1)`` into the values of two attention calls, ``torch.chunk(attn_output, 2, dim=2)`` of their output along the
    heads, combined pair by pair)."""
    return "torch.chunk(value_states, 2, dim=1)" in source and "torch.chunk(attn_output, 2, dim=2)" in source


def _paired_attention(arch, parent, blocks, roles, config, head_dim: int, local: dict[str, str],
                      extras: dict[str, object]) -> PairedHeadsAttention:
    """A PairedHeadsAttention for blocks whose forward pairs heads (``paired_heads``): widths of the config's heads,
    no gate, sink, norm with parameters or other layer kind beside (``extras``: refused if any), and the block's own
    parameters each a [head_dim] vector the forward reduces to one scalar (DiffLlama's ``torch.sum(self.lambda_q1 *
    self.lambda_k1, dim=-1)``), read alike by every head."""
    present = {what: value for what, value in extras.items() if value}
    if present:
        raise refuse(arch, parent, f"attention pairing head h with h + H/2 beside {present}; plait has no rule for "
                                   f"both")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    expected = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim, "o input": heads * head_dim}
    block = next(iter(blocks.values()))
    source = inspect.getsource(type(block).forward)
    scalars = {leaf for pair in re.findall(r"torch\.sum\(self\.(\w+) \* self\.(\w+), dim=-1", source) for leaf in pair}
    for name, b in blocks.items():
        widths = {r: out_features(get_module(b, roles[r])) for r in ("q", "k", "v")}
        widths["o input"] = linear_shape(get_module(b, roles["o"]))[0]
        if widths != expected:
            raise refuse(arch, name, f"paired-head attention widths {widths} are not heads x head_dim {expected}")
        inner = sorted(n for n, m in b.named_modules() if n and n not in {roles[r] for r in roles} and own_params(m))
        odd = sorted(n for n, p in b._parameters.items()
                     if p is not None and (n not in scalars or tuple(p.shape) != (head_dim,)))
        if inner or odd:
            raise refuse(arch, f"{name}.{(inner or odd)[0]}", "a parameter inside attention pairing head h with h + "
                                                              "H/2 that is not a [head_dim] vector reduced to one "
                                                              "scalar; plait cannot tell how its heads use it")
    shared = tuple(n for n, p in block._parameters.items() if p is not None)
    return PairedHeadsAttention(parent, q=roles["q"], k=roles["k"], v=roles["v"], o=roles["o"], num_heads=heads,
                                num_kv_heads=kv_heads, head_dim=head_dim, local_attrs=local, shared_params=shared)


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
    widths = {role: out_features(get_module(block, roles[role])) for role in ("q", "k", "v")}
    widths["o input"] = linear_shape(get_module(block, roles["o"]))[0]
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
        width = out_features(block.get_submodule(child))
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
