"""Megatron-style tensor-parallel layers with plain-tensor parameters.

Parameters keep the layout of the module they replace (``nn.Linear``: [out, in]; transformers ``Conv1D``:
[in, out]) so that state-dict names and slices map one-to-one onto Hugging Face checkpoints.
Plain tensors (not DTensor) keep ZeroRedundancyOptimizer, gloo, NCCL and XLA working (docs/decisions.md D1).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.tp import mappings

Group = dist.ProcessGroup | None


class TPRegionEntry:
    """Enters the tensor-parallel region once per input tensor, shared by all column-parallel layers.

    transformers feeds one tensor to q_proj, k_proj and v_proj (and to gate_proj and up_proj). Applying
    the entry mapping (f, or the sequence all-gather under SP) in each layer would triple the backward
    all-reduces; remembering the last input by identity applies it once, as Megatron's fused QKV does.
    """

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel
        self._last: tuple[weakref.ref, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._last is not None and self._last[0]() is x:
            return self._last[1]
        if self.sequence_parallel:
            entered = mappings.gather_from_seq(x, self.group, grad_is_partial=True)
        else:
            entered = mappings.copy_to_tp(x, self.group)
        self._last = (weakref.ref(x), entered)
        return entered

    def clear(self) -> None:
        """Drop the remembered activation (called after every forward so it is not kept alive)."""
        self._last = None


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:  # transformers Conv1D: y = x @ W + b with W [in, out]
        y = x @ weight
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over tp; input entered through ``entry`` (None: input already entered).

    ``out_features_valid`` trims padded output columns (vocab padding) so they never reach a logit.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        transposed: bool,
        entry: TPRegionEntry | None,
        out_features_valid: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.transposed, self.entry, self.out_features_valid = transposed, entry, out_features_valid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is not None:
            x = self.entry(x)
        y = _matmul(x, self.weight, self.bias, self.transposed)
        if self.out_features_valid is not None and self.out_features_valid < y.shape[-1]:
            y = y[..., : self.out_features_valid]
        return y

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, transposed={self.transposed}"


class RowParallelLinear(nn.Module):
    """Input features split over tp; partial outputs all-reduced, or reduce-scattered along the sequence
    under SP; the (replicated) bias is added once, after the reduction."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, group: Group, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.transposed, self.group, self.sequence_parallel = transposed, group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(x, self.weight, None, self.transposed)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_seq(y, self.group)
        else:
            y = mappings.reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, transposed={self.transposed}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_stop) of the embedding (plus zero padding rows); ids outside the range give
    zeros, and the partial embeddings are summed over tp."""

    def __init__(
        self, weight: torch.Tensor, vocab_start: int, vocab_stop: int, num_embeddings: int,
        padding_idx: int | None, group: Group,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.vocab_stop, self.num_embeddings = vocab_start, vocab_stop, num_embeddings
        self.embedding_dim = weight.shape[1]
        in_range = padding_idx is not None and vocab_start <= padding_idx < vocab_stop
        self.padding_idx = padding_idx - vocab_start if in_range else None
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = F.embedding(local, self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_stop}) of {self.num_embeddings}, local={tuple(self.weight.shape)}"


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """A vocab-parallel embedding whose lookups are multiplied by a constant, as transformers' scaled word
    embeddings (Gemma3 ``Gemma3TextScaledWordEmbedding``) do inside the embedding module. The scale is applied
    after the sum over tp, cast through float32 to the weight's dtype as transformers does, so the product is
    bit-identical to the unsplit module's."""

    def __init__(self, *args, scale: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(ids) * scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"
