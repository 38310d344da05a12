"""What context parallelism adds to a rank's memory and communication: its attention across the cp group.

Under cp (plait.cp) every rank holds S/C tokens of each sequence from the embedding to the loss, so every
activation the trace records per token is 1/C of cp=1's (``activations.unit_bytes`` divides it), and each
rank does 1/C of the FLOPs. Only attention sees the whole sequence, by one of two strategies per forward
(``CPPlan.strategy_for(seq)``); here, for one attention call (one decoder layer) over b sequences, with
n = S/C local tokens, Hq and Hkv the query and key/value heads of a tp rank (one replicated kv head per rank
when tp exceeds the kv heads, as ``plait.tp.styles.Attention`` splits them), head dims d (q, k) and dv (v),
e bytes per activation element:

all-to-all (Ulysses, plait.cp.ulysses): forward 4 ``all_to_all`` calls, handing in q (b Hq n d e bytes), k
(b Hkv' n d e), v (b Hkv' n dv e) and the output (b Hq n dv e), where Hkv' = r Hkv with r = C / gcd(Hkv, C)
copies of each kv head (so that the kv heads divide by C); backward the same 4, reversed; activation
checkpointing runs the forward 4 again in backward. Memory: the heads-split q, k, v over all S tokens are the
same bytes as the local ones (already in the trace, divided by C), except the r copies of k and v (r - 1
more, saved by the attention function for its backward); eager's S x S probabilities are 1/C of cp=1's (Hq/C
heads over S x S: the trace's, divided by C); and the whole sequence's mask, materialised inside each
attention call (b S^2 bytes of bool for sdpa, b S^2 e for eager's additive mask; other kernels take none),
counted as a transient of the call running. That is an upper bound for plain causal batches, where sdpa may
skip the mask (no padding, no packed documents), and a lower bound if a fused kernel saved its converted
float mask for backward in every layer (the memory-efficient kernel takes a bias it can keep; unmeasured).

ring (plait.cp.ring): forward C - 1 ring shifts of the local k (b Hkv n d e) and v (b Hkv n dv e), no kv
repetition; backward C - 1 shifts of k and v and C of their gradients, accumulated in the compute dtype (fp32,
or float64 for a float64 model: c bytes); recomputation repeats the forward shifts. ``plait.base.comm`` records
each tensor of a shift as one ``send`` (each paired with a receive of the same bytes, not listed). Memory:
the ring keeps no probabilities (eager's S x S tensors are dropped from the trace, as for fused kernels);
its transient is the scores of one (query tile, key tile) block, [b, Hq, t, t] with t = min(n/2, ring.TILE) in
the compute dtype,
three alive in backward (scores, probabilities, their gradient), plus the blocks in flight: k, v and their
gradients received beside the ones held (2 b Hkv n (d + dv) (e + c)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from plait.cp.ring import TILE
from plait.layout_plan import LayoutPlan


@dataclass(frozen=True)
class AttentionShape:
    """Heads of one tp rank and head dims of a model's attention."""

    q_heads: int
    kv_heads: int
    head_dim: int  # q and k
    v_head_dim: int

    @classmethod
    def of(cls, model_config: Any, tp: int) -> "AttentionShape":
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        nope, rope = getattr(text, "qk_nope_head_dim", None), getattr(text, "qk_rope_head_dim", None)
        qk_dim = nope + rope if nope and rope else head_dim  # multi-head latent attention
        v_dim = getattr(text, "v_head_dim", None) or head_dim
        return cls(heads // tp, kv // tp if kv >= tp else 1, qk_dim, v_dim)


def kv_copies(kv_heads: int, size: int) -> int:
    """All-to-all's copies of each kv head (plait.cp.ulysses.kv_repeats): their number then divides by ``size``."""
    return size // math.gcd(kv_heads, size)


def strategy(plan: LayoutPlan, seq: int) -> str | None:
    """The attention strategy a forward over ``seq``-token sequences uses under ``plan`` (None at cp=1)."""
    return plan.cp.strategy_for(seq) if plan.cp is not None else None


def attention_comm(
    plan: LayoutPlan, seq: int, sequences: int, act_bytes: int, compute_bytes: int, layers: int, recomputed: int,
) -> tuple[str, int, int]:
    """(op, count, bytes) of one micro-step's cp attention on a rank running ``layers`` decoder layers of which
    ``recomputed`` are recomputed, for ``sequences`` sequences of ``seq`` tokens (all micro-batches)."""
    config = plan.config
    size = config.cp
    shape = AttentionShape.of(plan.model_config, config.tp)
    n = seq // size
    m = config.num_microbatches  # plait runs every micro-batch's forward and backward apart (pp=1 too)
    if strategy(plan, seq) == "all-to-all":
        kv = shape.kv_heads * kv_copies(shape.kv_heads, size)
        per_call = sequences * n * act_bytes * (shape.q_heads * shape.head_dim + kv * shape.head_dim
                                                + kv * shape.v_head_dim + shape.q_heads * shape.v_head_dim)
        calls = 2 * layers + recomputed  # forward, backward, forward again
        return "all_to_all", 4 * calls * m, per_call * calls
    block = sequences * shape.kv_heads * n  # k and v of the local tokens: their bytes per head dim and element
    forward = (size - 1) * block * (shape.head_dim + shape.v_head_dim) * act_bytes
    backward = forward + size * block * (shape.head_dim + shape.v_head_dim) * compute_bytes
    count = 2 * (size - 1) * (2 * layers + recomputed) + 2 * size * layers
    return "send", count * m, forward * (layers + recomputed) + backward * layers


def attention_memory(plan: LayoutPlan, seq: int, sequences: int, act_bytes: int, compute_bytes: int,
                     implementation: str) -> tuple[int, int]:
    """(bytes saved per decoder layer beyond the trace's share, transient bytes of one attention call) for a
    micro-batch of ``sequences`` sequences under ``plan``'s cp strategy."""
    config = plan.config
    size = config.cp
    shape = AttentionShape.of(plan.model_config, config.tp)
    n = seq // size
    dims = shape.head_dim + shape.v_head_dim
    if strategy(plan, seq) == "all-to-all":
        extra = (kv_copies(shape.kv_heads, size) - 1) * sequences * shape.kv_heads * n * dims * act_bytes
        mask = {"sdpa": 1, "eager": act_bytes}.get(implementation, 0) * sequences * seq * seq
        return extra, mask
    scores = 3 * sequences * shape.q_heads * min(n // 2, TILE) ** 2 * compute_bytes
    blocks = 2 * sequences * shape.kv_heads * n * dims * (act_bytes + compute_bytes)
    return 0, scores + blocks
