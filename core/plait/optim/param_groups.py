"""Which parameters weight decay applies to: decided by logical parameter, so every layout agrees.

As in Megatron-LM and transformers' Trainer, biases and norm weights are not decayed; plait's rule is the
logical (unsharded) shape: a parameter of one dimension (a bias, a norm's weight) is not decayed, a matrix
is. The rule reads the full shape from the parameter's shard spec, never the local slice, so a column-parallel
bias or a vocab-padded embedding lands in the same group at tp=1 and tp=8, under ZeRO-1 and with fp32 masters.
Embeddings (token and position) are decayed unless the user asks otherwise (``decay_embeddings=False``).
Both groups always exist (a pipeline stage may hold no parameter of one), so group indices, which checkpoints
record per parameter, mean the same on every rank and layout.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from plait.tp.layers import VocabParallelEmbedding

EMBEDDINGS = (nn.Embedding, VocabParallelEmbedding)


def decays(full_shape: tuple[int, ...], is_embedding: bool, decay_embeddings: bool = True) -> bool:
    """Whether weight decay applies to a parameter of logical shape ``full_shape``."""
    return len(full_shape) >= 2 and (decay_embeddings or not is_embedding)


def embedding_params(module: nn.Module) -> set[str]:
    """Names of the parameters owned by embedding modules (token and position embeddings)."""
    return {f"{name}.{leaf}".lstrip(".") for name, sub in module.named_modules() if isinstance(sub, EMBEDDINGS)
            for leaf, _ in sub.named_parameters(recurse=False)}


def weight_decay_groups(
    named_params: Iterable[tuple[str, nn.Parameter]], full_shapes: dict[str, tuple[int, ...]], embeddings: set[str],
    weight_decay: float, decay_embeddings: bool = True,
) -> list[dict]:
    """Two parameter groups for a torch optimizer: ``weight_decay`` on matrices, 0 on the rest."""
    decayed, kept = [], []
    for name, param in named_params:
        if param.requires_grad:
            target = decayed if decays(full_shapes[name], name in embeddings, decay_embeddings) else kept
            target.append(param)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
