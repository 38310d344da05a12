"""Linears no rule splits, kept whole on every rank: written directly on a decoder layer (Zamba's ``linear`` after its
shared attention block, Gemma 4's ``per_layer_input_gate`` and ``per_layer_projection`` around the per-layer inputs),
or in a block of Linears only, token by token, that no rule reads (Zamba's and Zamba2's MLP inside their shared
attention block, Zamba2's with low-rank adapters beside its fused gate | up projection).

A Linear acts on each token alone. Without sequence parallelism every tp rank holds the whole sequence between the
tensor-parallel regions, so a Linear kept whole there computes and differentiates exactly what one process does.
Under SP the layer's activations are this rank's sequence shard (the side inputs the model hands its layers too:
``SPPlan.side_inputs``), so the Linear works on that shard's tokens and its gradient covers them alone: it is summed
over tp like the sequence-parallel norms' (``SPPlan.norms``). Splitting it instead would not pay: Gemma 4's
per-layer width is 256 beside a hidden size of thousands. Under SP a block kept whole this way does no work twice:
each rank runs it on its own shard.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

from plait_transformers.common import is_attention, is_softmax_attention, own_params

# Code that can move values between tokens (or reshape them into other dimensions): a block whose forward holds any
# of it is not token by token as far as plait can read.
TOKEN_MIXING = re.compile(r"\.(?:transpose|permute|view|reshape|flatten|unflatten|sum|mean|cumsum|cumprod|softmax|roll|"
                          r"flip|matmul|bmm)\(|torch\.(?:einsum|matmul|bmm|cat|concatenate|stack|conv\w*)\(|\.T\b|@")

# Modules that only hold others (Zamba2's adapter list, each adapter a Sequential of two Linears).
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def token_wise(model: nn.Module, layers: str, name: str) -> bool:
    """Whether the replicated module ``name`` inside the decoder layers works token by token, so that under SP it
    may run on the sequence shard with its gradient summed over tp: a Linear on the layer itself
    (``replicated_linear``) or in a block of Linears (``in_linear_block``)."""
    return replicated_linear(model, layers, name) or in_linear_block(model, layers, name)


def replicated_linear(model: nn.Module, layers: str, name: str) -> bool:
    """Whether module ``name`` is an ``nn.Linear`` child of one of the decoder layers ``layers`` whose forward calls
    it only on one name that is not an argument of the forward besides the hidden states (``x = self.linear(x)``):
    what it reads is then the hidden states or a value the layer computed, on their sequence shard under SP, never
    a tensor the layer was handed beside them whole (cross-attention's memory). Anything else is left to the
    refusal."""
    prefix, _, child = name.rpartition(".")
    if prefix.rpartition(".")[0] != layers or not isinstance(model.get_submodule(name), nn.Linear):
        return False
    forward = type(model.get_submodule(prefix)).forward
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    others = list(inspect.signature(forward).parameters)[2:]  # self, the hidden states
    read = re.findall(rf"self\.{re.escape(child)}\((\w+)\)", source)
    return bool(read) and len(read) == source.count(f"self.{child}(") and not set(read) & set(others)


def in_linear_block(model: nn.Module, layers: str, name: str) -> bool:
    """Whether module ``name`` is an ``nn.Linear`` in a block below a decoder layer (its nearest holder besides
    containers) that holds Linears only, is no attention, and whose forward has no code that could mix tokens
    (``TOKEN_MIXING``; Zamba's ``down(act(gate(x)) * up(x))``, Zamba2's gate | up ``torch.chunk`` on the last
    dimension), and no holder of which between it and the layer calls transformers' attention functions (whose
    internals see the whole sequence): the block then computes each token from that token alone."""
    parts = name.split(".")
    depth = layers.count(".") + 2  # layers.<index>
    if not isinstance(model.get_submodule(name), nn.Linear) or len(parts) <= depth + 1:
        return False
    holders = [".".join(parts[:i]) for i in range(len(parts) - 1, depth, -1)]  # nearest first, below the layer
    block = next((h for h in holders if not isinstance(model.get_submodule(h), CONTAINERS)), None)
    if block is None or any(is_softmax_attention(model.get_submodule(h)) for h in holders):
        return False
    module = model.get_submodule(block)
    if is_attention(module) or any(own_params(m) and not isinstance(m, nn.Linear) for m in module.modules()):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return TOKEN_MIXING.search(source) is None
