"""A tp plan read from the module tree, for a causal LM transformers declares none for (OPT, GPT-Neo, StableLM,
Persimmon, ...): the styles transformers declares for the same structures elsewhere, which ``tp_plan`` then maps
and checks exactly as a declared plan.

- the input embedding (a plain ``nn.Embedding``) vocab-parallel, the LM head column-parallel over the vocabulary;
- attention blocks need nothing here: ``undeclared_attention`` finds separate q/k/v/o projections by name;
- MLPs: a gated one (``down(act(gate(x)) * up(x))``) or a plain one of two linear layers, hidden -> inner ->
  hidden, and nothing else with parameters, each a child of the decoder layer: the first column-, the second
  row-parallel.

What it cannot place stays unstyled: attention with fused projections it cannot read, an MLP written on the
decoder layer itself (OPT's ``fc1`` / ``fc2``); ``tp_plan`` and the conformance kit then refuse or prove the plan.
"""

from __future__ import annotations

import inspect

from torch import nn

from plait.tp.sharding import linear_shape

from plait_transformers.common import is_attention, is_linear, own_params
from plait_transformers.mlp import gated_mlp, viewed_in_halves


def structural_tp_plan(model: nn.Module, layers: str | None) -> dict[str, str]:
    """Module pattern -> transformers style, as a tp plan transformers would declare for this structure."""
    plan: dict[str, str] = {}
    names = {id(m): n for n, m in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is nn.Embedding:
        plan[names[id(embedding)]] = "embedding_rowwise"
    if head is not None and is_linear(head):
        plan[names[id(head)]] = "colwise_gather_output"
    if layers is None:
        return plan
    hidden = embedding.embedding_dim if isinstance(embedding, nn.Embedding) else None
    for child, block in model.get_submodule(layers)[0].named_children():
        if not is_attention(block):
            plan.update({f"{layers}.*.{child}.{leaf}": style for leaf, style in _mlp_styles(block, hidden).items()})
    return plan


def _mlp_styles(block: nn.Module, hidden: int | None) -> dict[str, str]:
    """A gated MLP's styles, or a two-linear one's: plain (hidden -> inner -> hidden), or with its first linear's
    output gate | up viewed in halves (Moshi's fc1 -> 2 x inner, fc2 inner -> hidden: transformers' style for such a
    fused projection, colwise_gather_output, which block_rules splits as FusedColumn)."""
    gated = gated_mlp(block)
    if gated is not None:
        gate, up, down = gated
        return {gate: "colwise", up: "colwise", down: "rowwise"}
    with_params = [(n, m) for n, m in block.named_modules() if own_params(m)]
    if len(with_params) != 2 or not all(is_linear(m) and "." not in n for n, m in with_params):
        return {}
    (first, up), (second, down) = with_params
    up_in, up_out, _ = linear_shape(up)
    down_in, down_out, _ = linear_shape(down)
    if up_in != down_out or (hidden is not None and up_in != hidden):
        return {}
    if up_out == 2 * down_in and viewed_in_halves(inspect.getsource(type(block).forward), first):
        return {first: "colwise_gather_output", second: "rowwise"}
    return {first: "colwise", second: "rowwise"} if up_out == down_in else {}
