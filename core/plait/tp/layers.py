"""Megatron-style tensor-parallel layers with plain-tensor parameters.

Parameters keep the layout of the module they replace (``nn.Linear``: [out, in]; transformers ``Conv1D``:
[in, out]) so that state-dict names and slices map one-to-one onto Hugging Face checkpoints.
Plain tensors (not DTensor) keep ZeroRedundancyOptimizer, gloo, NCCL and XLA working (docs/decisions.md D1).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.base import comm
from plait.tp import mappings

Group = dist.ProcessGroup | None
Float8 = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x, weight [out, in] -> x @ weight.T (plait.parallel.float8)


class TPRegionEntry:
    """Enters the tensor-parallel region once per input tensor, shared by all column-parallel layers.

    transformers feeds one tensor to q_proj, k_proj and v_proj (and to gate_proj and up_proj). Applying
    the entry mapping (f, or the sequence all-gather under SP) in each layer would triple the backward
    all-reduces; remembering the last input by identity applies it once, as Megatron's fused QKV does.
    """

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel
        self._last: tuple[weakref.ref, torch.Tensor, int] | None = None  # input, what it entered as, its serial
        self._serial = 0  # numbers each entered input: what backward's regather recognises it by
        self._regathered: tuple[int, torch.Tensor] | None = None  # backward's re-gathered input, by serial

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter(x)[0]

    def enter(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``x`` entered (gathered under SP, else through f), and the serial number of that entry."""
        if self._last is not None and self._last[0]() is x:
            return self._last[1], self._last[2]
        if self.sequence_parallel:
            entered = mappings.gather_from_seq(x, self.group, grad_is_partial=True)
        else:
            entered = mappings.copy_to_tp(x, self.group)
        self._serial += 1
        self._last = (weakref.ref(x), entered, self._serial)
        return entered, self._serial

    def clear(self) -> None:
        """Drop the remembered activations (called after every forward so they are not kept alive)."""
        self._last = None
        self._regathered = None

    def shard_of(self, entered: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The input that ``entered`` was entered from and its serial, if it is the last one entered (a parent
        module's pre-hook entered it for its projections), else None."""
        if self._last is not None and self._last[1] is entered:
            shard = self._last[0]()
            return None if shard is None else (shard, self._last[2])
        return None

    def regather(self, shard: torch.Tensor, serial: int) -> torch.Tensor:
        """In backward, the whole sequence of a column-parallel layer's input from the shard it saved: one
        all-gather for the layers that share an input (q, k, v; gate, up), whose backwards run one after another,
        so one remembered tensor serves them all. Known by the serial its entry got in forward: the unpacked
        saved tensor is a new Python object each time, and an address can be reused once a shard is freed."""
        if self._regathered is None or self._regathered[0] != serial:
            self._regathered = (serial, comm.all_gather(shard, self.group, mappings.SEQ_DIM))
        return self._regathered[1]


def _matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, float8: Float8 | None = None,
) -> torch.Tensor:
    if float8 is not None:  # torchao's float8 matmul of the local shard (plait.parallel.float8; never transposed)
        y = float8(x, weight)
        return y if bias is None else y + bias.to(y.dtype)
    if transposed:  # transformers Conv1D: y = x @ W + b with W [in, out]
        y = x @ weight
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class _ColumnMatmulSavingShard(torch.autograd.Function):
    """A column-parallel matmul under sequence parallelism that saves its input's sequence shard, not the gathered
    whole sequence: backward all-gathers the shard again for the weight's gradient (Korthikanti et al. 2022,
    Megatron's SP). Each rank then keeps 1/tp of these inputs instead of a whole copy, at the price of one more
    all-gather per layer input in backward. ``full`` is the gathered input (its gradient flows back through the
    gather, which reduce-scatters it once for all layers sharing it); ``shard`` is passed only to be saved."""

    @staticmethod
    def forward(ctx, full, shard, weight, bias, transposed: bool, entry: TPRegionEntry, serial: int):
        y = _matmul(full, weight, bias, transposed)
        ctx.save_for_backward(shard, weight)
        ctx.transposed, ctx.entry, ctx.serial, ctx.has_bias, ctx.dtype = (transposed, entry, serial,
                                                                           bias is not None, y.dtype)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, weight = ctx.saved_tensors
        weight = weight.to(ctx.dtype)  # under autocast the forward ran in the autocast dtype
        grad_full = grad @ (weight.t() if ctx.transposed else weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            full = ctx.entry.regather(shard, ctx.serial).to(ctx.dtype)
            grad_2d, full_2d = grad.reshape(-1, grad.shape[-1]), full.reshape(-1, full.shape[-1])
            grad_weight = full_2d.t() @ grad_2d if ctx.transposed else grad_2d.t() @ full_2d
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_full, None, grad_weight, grad_bias, None, None, None


class ColumnParallelLinear(nn.Module):
    """Output features split over tp; input entered through ``entry`` (None: input already entered, by the parent
    module through ``parent_entry``, or not at all).

    Under SP the layer saves its input's sequence shard for backward, not the gathered input
    (``_ColumnMatmulSavingShard``). ``out_features_valid`` trims padded output columns (vocab padding) so they never
    reach a logit. ``float8``: set by ``plait.parallel.float8.apply_float8`` for a layer whose matmul runs in float8.
    """

    float8: Float8 | None = None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        transposed: bool,
        entry: TPRegionEntry | None,
        out_features_valid: int | None = None,
        parent_entry: TPRegionEntry | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.transposed, self.entry, self.out_features_valid = transposed, entry, out_features_valid
        self.parent_entry = parent_entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = self.entry or self.parent_entry
        if region is not None and region.sequence_parallel and self.float8 is None and torch.is_grad_enabled():
            # save the sequence shard, not the gathered input (float8 keeps its own kernel and what it saves)
            if self.entry is not None:
                (full, serial), shard = self.entry.enter(x), x
            else:
                full, found = x, region.shard_of(x)
                shard, serial = found if found is not None else (None, 0)
            if shard is not None:
                y = _ColumnMatmulSavingShard.apply(full, shard, self.weight, self.bias, self.transposed, region,
                                                   serial)
            else:
                y = _matmul(full, self.weight, self.bias, self.transposed)
        else:
            if self.entry is not None:
                x = self.entry(x)
            y = _matmul(x, self.weight, self.bias, self.transposed, self.float8)
        if self.out_features_valid is not None and self.out_features_valid < y.shape[-1]:
            y = y[..., : self.out_features_valid]
        return y

    def extra_repr(self) -> str:
        return f"local_weight={tuple(self.weight.shape)}, transposed={self.transposed}{_float8_repr(self.float8)}"


class RowParallelLinear(nn.Module):
    """Input features split over tp; partial outputs all-reduced, or reduce-scattered along the sequence
    under SP; the (replicated) bias is added once, after the reduction. ``float8`` as for ``ColumnParallelLinear``."""

    float8: Float8 | None = None

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, group: Group, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.transposed, self.group, self.sequence_parallel = transposed, group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _matmul(x, self.weight, None, self.transposed, self.float8)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_seq(y, self.group)
        else:
            y = mappings.reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"local_weight={tuple(self.weight.shape)}, transposed={self.transposed}, sp={self.sequence_parallel}"
                f"{_float8_repr(self.float8)}")


def _float8_repr(float8: Float8 | None) -> str:
    describe = getattr(float8, "describe", None)
    return f", {describe()}" if describe is not None else ""


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
    after the sum over tp, cast to the weight's dtype as transformers casts its buffer, so the product is
    bit-identical to the unsplit module's. ``scale`` is the value that buffer holds (``ScaledVocabEmbedding.scale``:
    float32-rounded where it was made float32, the exact root where a float64 default made it)."""

    def __init__(self, *args, scale: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = scale
        self._cast: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # made once per weight dtype, device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        key = (self.weight.dtype, self.weight.device)
        if key not in self._cast:  # float64 holds the buffer's value exactly; on the host: MPS has no float64
            self._cast[key] = torch.tensor(self.scale, dtype=torch.float64).to(key[0]).to(key[1])
        return super().forward(ids) * self._cast[key]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


class _GatherTokens(torch.autograd.Function):
    """All-gather flattened tokens ([tokens, ...], dim 0); backward reduce-scatters (the consumer's gradient
    is a partial sum over tp) or, for a consumer whose gradient is whole, splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, grad_is_partial: bool) -> torch.Tensor:
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return comm.all_gather(x, group, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grad_is_partial:
            return comm.reduce_scatter(grad.contiguous(), ctx.group, 0), None, None
        return comm.split(grad, ctx.group, 0), None, None


class _ReduceScatterTokens(torch.autograd.Function):
    """Sum partial outputs over tp and keep this rank's tokens (dim 0); backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(x.contiguous(), group, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather(grad.contiguous(), ctx.group, 0), None


class ExpertsRegion:
    """Makes a transformers experts module (``forward(hidden_states, top_k_index, top_k_weights)`` on flattened
    tokens, expert weights split over tp on their intermediate dimension) its own tensor-parallel region.

    Each rank computes every routed token's partial output through its slice of every expert; the partial
    outputs are summed over tp. Without SP the tokens and routing are the same on every rank: they enter with
    ``copy_to_tp`` (their gradients, partial, are summed in backward) and the output leaves with an all-reduce.
    Under SP a rank holds only its sequence shard's tokens, routed locally: tokens, expert indices and routing
    weights are all-gathered, and the partial outputs reduce-scattered back to the rank's own tokens (the
    flattened tokens of a sequence shard are one contiguous chunk, so dim 0 is the token dimension).
    """

    ARGS = ("hidden_states", "top_k_index", "top_k_weights")

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave)

    def _enter(self, module, args, kwargs):
        values = dict(zip(self.ARGS, args)) | {k: kwargs.pop(k) for k in self.ARGS if k in kwargs}
        hidden, index, weights = (values[k] for k in self.ARGS)
        if self.sequence_parallel:
            hidden = _GatherTokens.apply(hidden, self.group, True)
            index = comm.all_gather(index.contiguous(), self.group, 0)
            weights = _GatherTokens.apply(weights, self.group, True)
        else:
            hidden, weights = mappings.copy_to_tp(hidden, self.group), mappings.copy_to_tp(weights, self.group)
        return (hidden, index, weights, *args[len(self.ARGS):]), kwargs

    def _leave(self, module, args, output):
        if self.sequence_parallel:
            return _ReduceScatterTokens.apply(output, self.group)
        return mappings.reduce_from_tp(output, self.group)


class _SplitTokens(torch.autograd.Function):
    """This rank's share of flattened tokens held alike by every tp rank (dim 0); backward all-gathers the shares'
    gradients, so the replicated input gets its whole gradient on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.split(x, group, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_gather(grad.contiguous(), ctx.group, 0), None


class TokenShareRegion:
    """Routed experts kept whole on every tp rank, without SP: every tp rank holds the same tokens, so each
    computes a 1/tp share of the rows (padded to a multiple of tp with zero rows of routing weight 0, whose
    outputs count for nothing) and the outputs are all-gathered. The experts' weight gradients then cover a
    share of the tokens: they are summed over tp (``WholeExperts``). Under SP a rank's tokens are already its own
    sequence shard and this region is not installed."""

    ARGS = ExpertsRegion.ARGS

    def __init__(self, group: Group) -> None:
        self.group, self.size = group, comm.group_size(group)
        self.rows = 0

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave)

    def _enter(self, module, args, kwargs):
        values = dict(zip(self.ARGS, args)) | {k: kwargs.pop(k) for k in self.ARGS if k in kwargs}
        hidden, index, weights = (values[k] for k in self.ARGS)
        self.rows = hidden.shape[0]
        pad = -self.rows % self.size
        if pad:
            hidden = F.pad(hidden, (0, 0, 0, pad))
            index = F.pad(index, (0, 0, 0, pad))
            weights = F.pad(weights, (0, 0, 0, pad))
        share = (_SplitTokens.apply(hidden, self.group), comm.split(index, self.group, 0),
                 _SplitTokens.apply(weights, self.group))
        return (*share, *args[len(self.ARGS):]), kwargs

    def _leave(self, module, args, output):
        return _GatherTokens.apply(output.contiguous(), self.group, False)[:self.rows]


class WholeSequenceRegion:
    """Under SP, runs a block kept whole on every rank over the whole sequence (a recurrent or state-space mixer:
    its scan and causal convolution run along the sequence, so a sequence shard alone gives wrong outputs).

    The block's input (its first argument, by position or by the name ``argument``, and any other argument of its
    shape) is all-gathered from the sequence shards by the region entry, whose backward reduce-scatters: each rank's input gradient is partial.
    Each rank keeps its own shard of the output (``mappings.keep_seq_shard``, zero-padded in backward), so its
    parameter gradients cover its shard's outputs only: they are summed over tp like the sequence-parallel norms'.
    """

    def __init__(self, entry: TPRegionEntry, group: Group, argument: str = "hidden_states") -> None:
        self.entry, self.group, self.argument = entry, group, argument

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave)

    def _enter(self, module, args, kwargs):
        # every input of the hidden states' shape is a sequence (Bloom's attention adds the residual itself), gathered
        # alike; contiguous: the gathered sequence can be a strided view, and a whole block's code may ``view`` it
        # (DBRX's router flattens its input with ``view(-1, hidden)``), which a layer of the plan never does
        shape = (args[0] if args else kwargs[self.argument]).shape

        def gathered(value):  # of the hidden states' sequence shape, whatever its width (BERT's input_tensor)
            sequence = isinstance(value, torch.Tensor) and value.dim() == len(shape) and value.shape[:-1] == shape[:-1]
            return self.entry(value).contiguous() if sequence else value

        return tuple(gathered(a) for a in args), {k: gathered(v) for k, v in kwargs.items()}

    def _leave(self, module, args, output):
        if isinstance(output, torch.Tensor):
            return mappings.keep_seq_shard(output, self.group)
        # every output of the hidden states' shape is a sequence: DBRX's norm-attention-norm returns the residual and
        # the normed hidden states; attention weights and caches pass as they are
        first = output[0]
        kept = [mappings.keep_seq_shard(o, self.group) if isinstance(o, torch.Tensor) and o.shape == first.shape
                else o for o in output]
        return kept if isinstance(output, list) else tuple(kept)  # a list where the block returns one (GPT-1)


class ExpertMajorRegion:
    """``ExpertsRegion`` for an experts module that takes every token once per expert, already scaled by its
    routing score, expert-major (Llama4 ``Llama4TextExperts.forward(hidden_states)``: [experts * tokens, hidden],
    viewed as [experts, tokens, hidden]). Without SP it enters and leaves like ``ExpertsRegion``. Under SP the
    tokens are gathered along the tokens dimension of that view, not along dim 0 (which would interleave the
    ranks' experts), and the partial outputs reduce-scattered back along it."""

    ARGS = ("hidden_states",)

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel
        self.experts = 0

    def install(self, module: nn.Module) -> None:
        self.experts = next(module.parameters()).shape[0]  # expert weights are [experts, ...]
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave)

    def _enter(self, module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if self.sequence_parallel:
            by_token = hidden.view(self.experts, -1, hidden.shape[-1]).transpose(0, 1).contiguous()
            hidden = _GatherTokens.apply(by_token, self.group, True).transpose(0, 1).reshape(-1, hidden.shape[-1])
        else:
            hidden = mappings.copy_to_tp(hidden, self.group)
        return (hidden, *args[1:]), kwargs

    def _leave(self, module, args, output):
        if self.sequence_parallel:
            by_token = output.view(self.experts, -1, output.shape[-1]).transpose(0, 1).contiguous()
            return _ReduceScatterTokens.apply(by_token, self.group).transpose(0, 1).reshape(-1, output.shape[-1])
        return mappings.reduce_from_tp(output, self.group)


class RouterLogitsGather:
    """Replaces the router logits a router returns (output ``index``, [tokens, experts] of this rank's sequence
    shard) with all ranks' logits, so transformers' load-balancing loss (computed from the recorded logits) sees
    the whole sequence on every rank, as one process does. The tokens come rank by rank: the loss sums over
    tokens, so their order matters only with an attention mask, which ``ParallelModel`` refuses beside the
    router loss under SP and cp. Prepended, so the hook transformers installs to record the logits sees the
    gathered ones.

    Backward: under SP (``grad_is_partial=False``) each rank takes the gradient of its own tokens' logits (a
    split; the router's weight gradients are then summed over tp); under cp (True) the ranks' gradients are
    summed first (the gather's adjoint), each rank adding 1/cp of the loss (plait.cp.router)."""

    def __init__(self, group: Group, grad_is_partial: bool = False, index: int = 0) -> None:
        self.group, self.grad_is_partial, self.index = group, grad_is_partial, index

    def install(self, module: nn.Module) -> None:
        module.register_forward_hook(self._gather, prepend=True)

    def _gather(self, module, args, output):
        if not isinstance(output, tuple):
            return _GatherTokens.apply(output, self.group, self.grad_is_partial)
        i = self.index
        return (*output[:i], _GatherTokens.apply(output[i], self.group, self.grad_is_partial), *output[i + 1:])


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) forward and backward: a sum every rank consumes in part (a norm's sum of squares)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return comm.all_reduce(grad.contiguous().clone(), ctx.group), None


class SplitRMSNorm(nn.Module):
    """RMSNorm over a feature dimension split over tp (OLMo2's q/k norms over all heads' features): the sum of
    squares is all-reduced instead of gathering the activations. ``copies``: how many tp ranks hold each slice
    (replicated kv heads), so the sum counts every feature once. Computes in float32 and multiplies the weight
    there, as transformers' ``Olmo2RMSNorm`` does."""

    def __init__(self, weight: torch.Tensor, eps: float, full_width: int, copies: int, group: Group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.eps, self.full_width, self.copies, self.group = eps, full_width, copies, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        sum_sq = x.pow(2).sum(-1, keepdim=True)
        if not comm.trivial(self.group):
            sum_sq = _SumOverTP.apply(sum_sq, self.group)
        variance = sum_sq / (self.full_width * self.copies)
        return (self.weight * (x * torch.rsqrt(variance + self.eps))).to(dtype)

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)} of {self.full_width}, eps={self.eps}, copies={self.copies}"
