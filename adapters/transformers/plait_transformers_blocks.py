"""Tensor-parallel rules for one block of a decoder layer: attention (separate q/k/v, fused qkv in the two layouts
transformers' models use, per-head and full-width q/k norms, gates, sinks), a latent-attention block
(plait_transformers_latent), an MLP (column / row, fused gate|up, scalar activation parameters), blocks
transformers' plan leaves out but the model's structure shows, and recurrent mixers kept whole.
"""

from __future__ import annotations

import inspect
import re
from collections import defaultdict

from torch import nn
from transformers.activations import ACT2CLS

from plait import Attention, Column, Row
from plait.patterns import matches
from plait.tp.sharding import linear_shape
from plait.tp.styles import (
    FullWidthNormAttention, FusedColumn, HeadInterleavedAttention, LocalConfigAttention, PairedHeadsAttention,
    ReplicatedGradSum, SplitNorm, TPRule, WholeSequence,
)

from plait_transformers_common import (
    CONFIG_READS, GATHERED, K, LINEAR_STYLES, LOCAL_ATTRS, O, Q, QKV, V, get_module, head_biases, is_attention,
    is_covered, is_linear, is_softmax_attention, layer_pattern, out_features, own_params, Refusal, refuse,
    whole_sequence,
)
from plait_transformers_latent import latent_attention_rules, is_latent_attention
from plait_transformers_layer_linears import replicated_linear


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
        roles = {role: next((p for c in names if (p := _linear_path(module, c))), None)
                 for role, names in (("q", Q), ("k", K), ("v", V), ("o", O))}
        source = inspect.getsource(type(module).forward)
        fused = next((c for c in QKV if isinstance(module._modules.get(c), nn.Linear)), None)
        if roles["q"] is None and fused and roles["o"] and \
                ("ALL_ATTENTION_FUNCTIONS" in source or head_biases(module)) and \
                module._modules[fused].out_features == 3 * module._modules[roles["o"]].in_features:
            # multi-head attention with one fused q/k/v projection (Persimmon's query_key_value), or computing its
            # scores itself with an ALiBi bias per head (Bloom, MPT; the bias sliced to each rank's heads): its
            # layout is checked as a declared one's; GPT-BigCode's multi-query c_attn is narrower and stays unsplit
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


def _linear_path(block: nn.Module, child: str) -> str | None:
    """``child`` where it is a Linear; ``child.<inner>`` where it wraps one Linear, holding nothing else, and its
    forward returns that Linear of its first argument (Moshi's MoshiLinear: ``return self.linear(x)``), so that the
    wrapper adds nothing to split; else None."""
    module = block._modules.get(child)
    if isinstance(module, nn.Linear):
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


def undeclared_mixers(model: nn.Module, arch: str, layers: str | None, rules: list[TPRule],
                      notes: list[str]) -> list[TPRule]:
    """Children of the decoder layers holding matrices that no rule touches (a recurrent mixer transformers' plan
    leaves out, such as OLMo-Hybrid's gated delta net; an attention with its own kernel and a fused projection no
    rule reads, such as Bloom's; softmax attention whose projections no rule splits: GPT-BigCode's multi-query
    ``c_attn``, Zaya's convolved q/k, JetMoE's mixture of attention heads): kept whole on every rank, which is exact
    without SP, and run on the whole sequence under SP (WholeSequence). One rule per layer
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
            if not any(p.dim() > 1 for p in module.parameters()):
                continue
            if not any(is_covered(n, patterns) for n, _ in module.named_modules(prefix=name)):
                found[pattern].append((name, module))
    mixers: list[TPRule] = []
    for pattern, hits in found.items():
        names = [pattern] if len(hits) == seen[pattern] else [name for name, _ in hits]
        mlp = gated_mlp(hits[0][1])
        if mlp and all(gated_mlp(module) == mlp for _, module in hits):
            mixers += [style(f"{name}.{child}") for name in names for style, child in zip((Column, Column, Row), mlp)]
            norm = mlp_sub_norm(hits[0][1])  # over the split product, before the row-parallel down projection
            mixers += [SplitNorm(f"{name}.{norm[0]}") for name in names] if norm else []
            notes.append(f"{pattern} ({type(hits[0][1]).__name__}): an MLP transformers' plan leaves out, split as "
                         f"declared ones ({mlp[0]}, {mlp[1]} column-, {mlp[2]} row-parallel)")
            continue
        mlp = direct_mlp(model.get_submodule(layers)[0])
        if mlp and child_of(pattern) in mlp and len(hits) == seen[pattern]:
            mixers.append((Column if child_of(pattern) == mlp[0] else Row)(pattern))
            notes.append(f"{pattern}: an MLP written on the decoder layer ({mlp[0]} -> activation -> {mlp[1]}), "
                         f"split as declared ones ({mlp[0]} column-, {mlp[1]} row-parallel)")
            continue
        if all(replicated_linear(model, layers, name) for name, _ in hits):  # Zamba's linear, Gemma 4's per-layer
            notes.append(f"{pattern}: a Linear on the decoder layer itself, token by token: kept whole on every "
                         f"rank, its gradient summed over tp under SP")
            continue
        if is_linear(hits[0][1]):  # OPT's fc1 / fc2: an MLP written on the decoder layer itself, among its norms
            raise refuse(arch, pattern, f"a {type(hits[0][1]).__name__} directly on the decoder layer that no rule "
                                        f"splits (an MLP written on the layer itself, but not as x = fc2(act(fc1(x))) "
                                        f"on the hidden states, whole or flattened to [tokens, hidden]); write an adapter (`plait plan "
                                        f"--show-derived {arch}` starts one)")
        each = [whole_sequence(arch, name, module) for name, module in hits]
        mixers += [WholeSequence(pattern, argument=each[0].argument)] if len(hits) == seen[pattern] else each
        notes.append(f"{pattern} ({type(hits[0][1]).__name__}): no rule splits it; kept whole on every rank and run "
                     f"on the whole sequence under SP")
    return mixers


def child_of(pattern: str) -> str:
    return pattern.rpartition(".")[2]


def direct_mlp(layer: nn.Module) -> tuple[str, str] | None:
    """(first, second) of an MLP written on the decoder layer itself (XGLM, TrOCR, BioGPT: ``fc1`` and ``fc2``), where
    the layer's forward runs ``x = second(act(first(x)))`` on its hidden states, with only parameter-free
    activations and dropout between: the first column-, the second row-parallel, as a block of its own would be. The
    hidden states may be flattened to [tokens, hidden] first (OPT: ``reshape(-1, hidden_states.size(-1))``): the
    sequence all-gather and reduce-scatter work on the second-to-last dimension, the tokens, and every op between
    them is token by token. A forward that reshapes anything else before them, or does anything else between them,
    gets None."""
    lines = [line.strip() for line in inspect.getsource(type(layer).forward).splitlines()]
    linears = {n: m for n, m in layer.named_children() if isinstance(m, nn.Linear)}
    free = {n for n, m in layer.named_children() if not any(True for _ in m.parameters())}
    for first, up in linears.items():
        for second, down in linears.items():
            if up.out_features != down.in_features or up.in_features != down.out_features or first == second:
                continue
            start = next((i for i, line in enumerate(lines) if f"self.{first}(" in line), None)
            end = next((i for i, line in enumerate(lines) if f"self.{second}(" in line), None)
            if start is None or end is None or end < start:
                continue
            between = lines[start:end + 1]
            if _reshapes_tokens_only(lines[:start]) and all(_elementwise(line, first, second, free) for line in between):
                return first, second
    return None


def _reshapes_tokens_only(lines: list[str]) -> bool:
    """Whether every reshape in ``lines`` (a layer's forward up to its MLP) keeps the last dimension and flattens the
    rest into tokens (``x = x.reshape(-1, x.size(-1))``) or no reshape is there."""
    token = r"\w+ = (\w+)\.(?:reshape|view)\(-1, \1\.(?:size\(-1\)|shape\[-1\])\)"
    return all(re.fullmatch(token, line) for line in lines if re.search(r"\.(reshape|view|flatten)\(", line))


def _elementwise(line: str, first: str, second: str, free: set[str]) -> bool:
    """Whether a line between the two linears of a direct MLP is ``x = op(x)``: one of them, a parameter-free child
    (the activation) or dropout, or the activation of the first (``x = self.act(self.fc1(x))``); blank or comment."""
    if not line or line.startswith("#"):
        return True
    ops = rf"(?:self\.(?:{'|'.join(map(re.escape, {first, second} | free))})|nn\.functional\.dropout|F\.dropout)"
    return re.fullmatch(rf"(\w+) = {ops}\((?:{ops}\()?\1(?:, [^()]*)?\)?\)", line) is not None


def gated_mlp(block: nn.Module) -> tuple[str, str, str] | None:
    """(gate, up, down) of a gated MLP whose forward is ``down(act(gate(x)) * up(x))`` over three Linear children
    and nothing else with parameters (AFMoE's dense layers; LFM2-MoE's ``w2(F.silu(w1(x)) * w3(x))``), or with an
    RMSNorm over the product before ``down`` (BitNet's ``ffn_sub_norm``, ``mlp_sub_norm`` names it), else None."""
    found = re.search(r"self\.(\w+)\(\s*(?:self\.\w+\(\s*)?"  # down, and a norm around the product if any
                      r"[\w.]+\(self\.(\w+)\((\w+)\)\)\s*\*\s*self\.(\w+)\(\3\)\s*\)",
                      inspect.getsource(type(block).forward))
    if found is None:
        return None
    down, gate, _, up = found.groups()
    names = (gate, up, down)
    with_params = {n for n, m in block.named_modules() if own_params(m)}
    norm = (mlp_sub_norm(block) or (None,))[0]
    if with_params - {norm} != set(names) or not all(isinstance(block._modules.get(n), nn.Linear) for n in names):
        return None
    return names


def mlp_sub_norm(block: nn.Module) -> tuple[str, str] | None:
    """(norm, down) of a gated MLP normalising ``act(gate(x)) * up(x)`` right before its down projection
    (``down(norm(act(gate(x)) * up(x)))``) where the norm is a split RMSNorm (``split_sub_norm``), else None."""
    found = re.search(r"self\.(\w+)\(\s*self\.(\w+)\(\s*[\w.]+\(self\.\w+\(\w+\)\)\s*\*",
                      inspect.getsource(type(block).forward))
    return (found.group(2), found.group(1)) if found and split_sub_norm(block, found.group(2), found.group(1)) else None


def split_sub_norm(block: nn.Module, child: str, consumer: str) -> bool:
    """Whether ``child`` is an RMSNorm (``weight * x * rsqrt(mean(x^2) + eps)``, one weight as wide as the
    features) whose output goes straight into the row-parallel ``consumer`` (BitNet's ``attn_sub_norm`` before
    ``o_proj``, ``ffn_sub_norm`` before ``down_proj``): its features are split over tp, so it is split with them
    and its sum of squares all-reduced (SplitNorm), which is exact."""
    module, target = block._modules.get(child), block._modules.get(consumer)
    if module is None or not is_linear(target) or "RMSNorm" not in type(module).__name__:
        return False
    params = dict(module.named_parameters())
    if set(params) != {"weight"} or tuple(params["weight"].shape) != (linear_shape(target)[0],):
        return False
    norm = inspect.getsource(type(module).forward)
    if "rsqrt(" not in norm or "return self.weight * " not in norm:
        return False
    source = inspect.getsource(type(block).forward)
    chained = rf"self\.{consumer}\(\s*self\.{child}\("
    stepwise = rf"(\w+) = self\.{child}\(\1\)[^\n]*\n\s*\w+ = self\.{consumer}\(\1\)"
    return re.search(chained, source) is not None or re.search(stepwise, source) is not None


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


def bare_refusal(arch: str, parent: str, params: dict[str, str]) -> Refusal:
    """The refusal for parameters transformers' plan shards by themselves where plait has no rule for them."""
    leaf, style = next(iter(params.items()))
    return refuse(arch, f"{parent}.{leaf}", f"transformers shards the parameter itself ({style}); plait splits bare "
                                            f"parameters only with the q heads of a q/k/v attention block")


def block_rules(model, config, parent: str, block: nn.Module, styles: dict[str, str],
                 bare: dict[str, str]) -> list[TPRule]:
    """The rules of one block transformers' plan styles children of (``bare``: its parameters the plan styles)."""
    arch = config.model_type
    roles = {role: next((s for c in names for s in styles if s == c or s.startswith(f"{c}.")), None)  # a wrapped one
             for role, names in (("q", Q), ("k", K), ("v", V), ("o", O))}
    if roles["q"] and roles["k"] and roles["v"]:
        return _attention_rules(model, config, parent, styles, roles, bare)
    if is_latent_attention(block):
        return latent_attention_rules(model, config, parent, block, styles, bare)
    if bare:
        raise bare_refusal(arch, parent, bare)
    fused = next((c for c in QKV if c in styles), None)
    if fused and roles["o"]:
        return _fused_attention_rules(config, parent, block, styles, fused, roles["o"])
    if all(style == "colwise_gather_output" for style in styles.values()) and not is_softmax_attention(block):
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
    norm, down = mlp_sub_norm(block) or (None, None)
    norm = norm if styles.get(down) == "rowwise" else None
    stray = [n for n, m in block.named_modules() if n and n not in styles and n != norm and own_params(m)]
    columns = [r.pattern.rpartition(".")[2] for r in rules if isinstance(r, Column)]
    unknown = [n for n in stray if not is_scalar_activation(block, n, columns)]
    if unknown:
        raise refuse(arch, f"{parent}.{unknown[0]}", "replicated parameters inside a tensor-parallel block see split "
                                                     "activations; plait cannot tell how to sum their gradients")
    split = [SplitNorm(f"{parent}.{norm}")] if norm else []
    return [*rules, *split, *(ReplicatedGradSum(f"{parent}.{n}") for n in stray)]


def is_scalar_activation(block: nn.Module, child: str, columns: list[str]) -> bool:
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
    source = inspect.getsource(type(block).forward)
    halves = "gate_up" in child and ".chunk(2" in source or viewed_in_halves(source, child)
    if halves and out_features(block.get_submodule(child)) == 2 * (fan_in or -1):
        return FusedColumn(name, chunks=2)
    raise refuse(arch, name, "transformers gathers this projection's output (colwise_gather_output) for an op over "
                             "the full width that plait does not know; it has no real split for it")


def viewed_in_halves(source: str, child: str) -> bool:
    """Whether a forward views ``child``'s output as two halves, gate and up, and multiplies them (Moshi's gating
    MLP: ``x = self.fc1(x)``, ``x.view(batch_size, sequence_length, 2, -1)``,
    ``self.activation_fn(x[..., 0, :]) * x[..., 1, :]``): a FusedColumn's matching slices of each half."""
    read = re.search(rf"(\w+) = self\.{child}\(\w+\)", source)
    if read is None:
        return False
    x = read.group(1)
    return f"{x} = {x}.view(batch_size, sequence_length, 2, -1)" in source and \
        re.search(rf"{x} = self\.\w+\({x}\[\.\.\., 0, :\]\) \* {x}\[\.\.\., 1, :\]", source) is not None


def _fused_attention_rules(config, parent, block, styles, qkv: str, o: str) -> list[TPRule]:
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
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
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
            raise refuse(arch, f"{name}.{(inner or odd)[0]}", f"a parameter inside attention pairing head h with h + "
                                                              f"H/2 that is not a [head_dim] vector reduced to one "
                                                              f"scalar; plait cannot tell how its heads use it")
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
