"""Tensor-parallel rules for one block of a decoder layer, by its kind: attention (attention.py), latent attention
(latent.py), or an MLP or other block of column- and row-parallel projections (fused gate|up, scalar activation
parameters; what the rules read of an MLP is in mlp.py). Also the rules for the children of the decoder layers that
transformers' plan leaves out: MLPs the model's structure shows, Linears kept whole token by token, and recurrent
mixers kept whole (``undeclared_mixers``).
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from plait import Column, Row
from plait.tp.styles import ReplicatedGradSum, SplitNorm, TPRule, WholeSequence

from plait_transformers.attention import attention_rules, fused_attention_rules
from plait_transformers.common import (
    GATHERED, K, LINEAR_STYLES, O, Q, QKV, V, Refusal, is_attention, is_covered, is_linear, is_softmax_attention,
    own_params, refuse, whole_sequence,
)
from plait_transformers.latent import is_latent_attention, latent_attention_rules
from plait_transformers.layer_linears import replicated_linear
from plait_transformers.mlp import direct_mlp, fused_column, gated_mlp, is_scalar_activation, mlp_sub_norm


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
        return attention_rules(model, config, parent, styles, roles, bare)
    if is_latent_attention(block):
        return latent_attention_rules(model, config, parent, block, styles, bare)
    if bare:
        raise bare_refusal(arch, parent, bare)
    fused = next((c for c in QKV if c in styles), None)
    if fused and roles["o"]:
        return fused_attention_rules(config, parent, block, styles, fused, roles["o"])
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
            rules.append(fused_column(arch, name, block, child, styles))
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
