"""Ring attention: key/value blocks passed around the cp group, partial softmaxes merged exactly.

Each rank keeps its queries and sends its keys and values on around the ring; at each of C steps it attends
to the block it holds and merges the result into a running output with the log-sum-exp rule (the softmax
over all keys, computed a tile at a time, as flash attention does within one device). The mask of each
(query tile, key tile) pair comes from transformers' own index function (``SequenceMask.block``); a tile the
mask empties entirely (the future under a causal mask, other documents, outside a window) is not computed,
and tiles of at most ``TILE`` tokens bound the memory of one block's scores. No head-count limit: grouped query heads are attended as extra rows of their
key/value head, so only the model's own kv heads travel.

The attention itself is the eager definition transformers uses: softmax(q k^T * scaling, soft-capped as
``tanh(x / cap) * cap`` when the model passes ``softcap``, masked, with the per-head sink logits of
``s_aux`` in the denominator) @ v. Backward recomputes each block from the saved log-sum-exp and sends the
key/value gradients around the ring behind their blocks, so they arrive home after C steps. Attention
dropout has no exact counterpart here and is refused (plait.cp.layout picks all-to-all instead).

Communication per attention call: C-1 ring shifts of k and v forward; backward C-1 of k and v and C of
their gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.base import comm
from plait.base.words import setting
from plait.cp.masks import EMPTY, FULL, SequenceMask
from plait.cp.sequence import chunk_bounds

_NEG_INF = float("-inf")
TILE = 1024  # tokens: the scores of one block are [batch, heads, TILE, TILE] at most


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that attend to nothing yet) replaced by 0, so exp(x - lse) stays 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _tiles(start: int, stop: int) -> list[tuple[int, int]]:
    return [(a, min(a + TILE, stop)) for a in range(start, stop, TILE)]


def _blocks(mask: SequenceMask, rank: int, owner: int) -> list[tuple[slice, slice, torch.Tensor | None]]:
    """The (query tile, key tile) blocks of one ring step that the mask does not empty: (rows of this rank's
    queries, columns of the block held, the mask [batch, 1, 1, rows, cols] broadcast over kv heads and groups,
    or None where it keeps everything). Tiles of at most TILE tokens bound the scores of one block; an empty
    tile is skipped (under a causal mask the future, under a window the far past, across packed documents the
    other documents)."""
    seq, size = mask.seq, mask.context.cp.size
    found = []
    for qa, q in zip((0, 1), chunk_bounds(seq, size, rank)):
        for kb, kv in zip((0, 1), chunk_bounds(seq, size, owner)):
            for q0, q1 in _tiles(*q):
                for k0, k1 in _tiles(*kv):
                    tile = mask.tile((q0, q1), (k0, k1))
                    if tile is not EMPTY:
                        rows = slice(qa * (q[1] - q[0]) + q0 - q[0], qa * (q[1] - q[0]) + q1 - q[0])
                        cols = slice(kb * (kv[1] - kv[0]) + k0 - kv[0], kb * (kv[1] - kv[0]) + k1 - kv[0])
                        found.append((rows, cols, None if tile is FULL else tile[:, :, None]))
    return found


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 at least (bf16 inputs are attended in fp32, as eager's softmax is), float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None):
    """Soft-capped scores [b, kv heads, groups, rows, cols] and the tanh (for backward) or None."""
    x = torch.einsum("bhgnd,bhmd->bhgnm", q, k) * scaling
    if softcap is None:
        return x, None
    t = torch.tanh(x / softcap)
    return t * softcap, t


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask: SequenceMask, scaling: float, softcap: float | None):
        cp = mask.context.cp
        batch, kv_heads, n, _ = k.shape
        groups = q.shape[1] // kv_heads
        dtype = _compute_dtype(q)
        qg = q.to(dtype).view(batch, kv_heads, groups, n, q.shape[-1])
        lse = qg.new_full((batch, kv_heads, groups, n), _NEG_INF)
        out = qg.new_zeros((batch, kv_heads, groups, n, v.shape[-1]))
        block_k, block_v = k, v
        for step in range(cp.size):
            last = step == cp.size - 1
            arriving = None if last else comm.ring_shift([block_k, block_v], cp.group)  # overlaps this block
            owner = (cp.rank - step) % cp.size
            for rows, cols, allowed in _blocks(mask, cp.rank, owner):
                x, _ = _scores(qg[:, :, :, rows], block_k[:, :, cols].to(dtype), scaling, softcap)
                if allowed is not None:
                    x = x.masked_fill(~allowed, _NEG_INF)
                block_lse = torch.logsumexp(x, dim=-1)
                p = torch.exp(x - _finite(block_lse)[..., None])
                o = torch.einsum("bhgnm,bhmd->bhgnd", p, block_v[:, :, cols].to(dtype))
                new = torch.logaddexp(lse[..., rows], block_lse)
                keep, add = torch.exp(lse[..., rows] - _finite(new)), torch.exp(block_lse - _finite(new))
                out[..., rows, :] = out[..., rows, :] * keep[..., None] + o * add[..., None]
                lse[..., rows] = new
            if arriving is not None:
                block_k, block_v = arriving()
        if sinks is not None:
            sink = sinks.to(dtype).view(1, kv_heads, groups, 1)
            total = torch.logaddexp(lse, sink.expand_as(lse))
            out = out * torch.exp(lse - total)[..., None]
            lse = total
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.scaling, ctx.softcap = mask, scaling, softcap
        return out.view(batch, kv_heads * groups, n, v.shape[-1]).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        mask, scaling, softcap = ctx.mask, ctx.scaling, ctx.softcap
        cp = mask.context.cp
        batch, kv_heads, n, _ = k.shape
        groups = q.shape[1] // kv_heads
        dtype = _compute_dtype(q)
        qg = q.to(dtype).view(batch, kv_heads, groups, n, q.shape[-1])
        dout = grad_out.to(dtype).reshape(batch, kv_heads, groups, n, v.shape[-1])
        delta = (dout * out).sum(-1)  # [b, h, g, n]
        dq = torch.zeros_like(qg)
        block_k, block_v = k, v
        grads_arriving = None  # the gradients of the block now held, accumulated by the ranks it visited before
        for step in range(cp.size):
            last = step == cp.size - 1
            arriving = None if last else comm.ring_shift([block_k, block_v], cp.group)  # overlaps this block
            owner = (cp.rank - step) % cp.size
            dk, dv = torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype)
            for rows, cols, allowed in _blocks(mask, cp.rank, owner):
                kb, vb = block_k[:, :, cols].to(dtype), block_v[:, :, cols].to(dtype)
                x, t = _scores(qg[:, :, :, rows], kb, scaling, softcap)
                p = torch.exp(x - lse[..., rows, None])
                if allowed is not None:
                    p = p.masked_fill(~allowed, 0.0)
                dv[:, :, cols] += torch.einsum("bhgnm,bhgnd->bhmd", p, dout[..., rows, :])
                ds = p * (torch.einsum("bhgnd,bhmd->bhgnm", dout[..., rows, :], vb) - delta[..., rows, None])
                if t is not None:
                    ds = ds * (1 - t * t)
                dq[..., rows, :] += torch.einsum("bhgnm,bhmd->bhgnd", ds, kb) * scaling
                dk[:, :, cols] += torch.einsum("bhgnm,bhgnd->bhmd", ds, qg[:, :, :, rows]) * scaling
            if grads_arriving is not None:
                earlier_dk, earlier_dv = grads_arriving()
                dk, dv = dk + earlier_dk, dv + earlier_dv
            grads_arriving = comm.ring_shift([dk, dv], cp.group)  # on behind the block; after C steps, home
            if arriving is not None:
                block_k, block_v = arriving()
        dk, dv = grads_arriving()  # the gradients of the block this rank started with
        dsinks = None
        if sinks is not None:
            p_sink = torch.exp(sinks.to(dtype).view(1, kv_heads, groups, 1) - lse)
            dsinks = (-(p_sink * delta)).sum(dim=(0, 3)).reshape(sinks.shape).to(sinks.dtype)
        return (dq.view_as(q).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None)


def ring_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: SequenceMask,
    scaling: float | None = None, dropout: float = 0.0, softcap: float | None = None,
    s_aux: torch.Tensor | None = None, **_: Any,
) -> torch.Tensor:
    """Attention of this rank's [batch, heads, S/C, dim] slices over the whole sequence (eager semantics);
    returns [batch, S/C, heads, value dim] as transformers' attention functions do."""
    if dropout:
        raise RuntimeError(
            f"{type(module).__name__}: attention dropout {dropout} has no exact ring counterpart; use "
            f"{setting('cp_attention', 'all-to-all')} (or auto) or set attention_dropout=0"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = _RingAttention.apply(query, key, value, s_aux, mask, scaling, softcap)
    return out.transpose(1, 2).contiguous()
