"""Batched, KV-cached decoding from a laid-out model's own shards: the loop and the token choice behind
``ParallelModel.generate``, which gives it the forward on its shards.

Every rank passes the same global batch of prompts (left padded, with their attention mask); each data-parallel
replica decodes its contiguous rows, the tp ranks of a replica together: each holds its heads' keys and values in
transformers' own cache (its attention layers run on their local heads) and the vocab-parallel head's slices are
joined into the full logits before a token is picked. The result is the whole batch's, on every rank.

Sampling is the same in every layout and in one process: a step's noise is drawn for the whole global batch from
one generator seeded with ``seed`` (every rank draws the same), each replica taking its rows' part; a token is the
argmax of the filtered, tempered logits plus Gumbel noise, which samples the softmax (the Gumbel-max trick).
Temperature 0 is greedy: transformers' ``generate`` on one process, token for token.

Every rank runs the same number of forwards (tp, ep and ZeRO-3's collectives run inside them): decoding stops when
every row of the global batch has met an end token (``eos_token_id``: one id or several, as transformers'
generation config gives a chat model's end of turn beside its EOS) or a stopping criterion of transformers' (a stop
string's ``StopStringCriteria``) holds for it, or after ``max_new_tokens``.

Held to one process (tests/test_generate.py): tp with and without sequence parallelism (under it every forward's
tokens are a multiple of tp: masked pads, ``decode``'s ``width``), data parallelism, ZeRO-1/2/3, expert parallelism
(each replica's rows dispatched to the experts' ranks in every forward), pipeline parallelism with a stage a rank
(``plait.generation.pipelined``: micro-batches through the stages, each stage's own KV caches: ``StageCache``), context
parallelism (each cp rank decodes its replica's rows whole, with the model's own attention: the cache is not split),
LoRA, several pipeline stages a rank (the interleaved schedules' placement); an image-text model's prompts with
their images (``plait.generation.images``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from plait.base.config import ConfigError
from plait.base.mesh import Mesh

Criteria = Callable[[torch.Tensor, None], torch.Tensor]  # transformers' StoppingCriteria(List): rows so far -> done


def check_batch(mesh: Mesh, batch: int) -> None:
    """One line for a batch the replicas cannot share; nothing has run."""
    if batch % mesh.dp:
        raise ConfigError(f"generation of a batch of {batch} prompts over dp={mesh.dp} replicas: the batch must be a "
                          f"multiple of dp")


def pick(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, top_k: int, top_p: float,
         ) -> torch.Tensor:
    """The next token of each row of ``logits`` [rows, vocab]: greedy at temperature 0, else sampled with top-k
    and top-p (nucleus) filtering as transformers' warpers do, by adding ``noise`` (standard Gumbel)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return (logits + noise).argmax(-1)


def ended(token: torch.Tensor, eos_token_id: int | Sequence[int] | None) -> torch.Tensor:
    """Which of ``token`` [rows] end their row: one of ``eos_token_id`` (none where it is None)."""
    ends = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.isin(token, torch.tensor(ends, dtype=token.dtype, device=token.device))


def rows_ended(ids: torch.Tensor | None, token: torch.Tensor, eos_token_id: int | Sequence[int] | None,
             stopping_criteria: Criteria | None) -> torch.Tensor:
    """Which rows ``token`` ends: an end token (``ended``), or ``stopping_criteria`` holding for the rows so far
    (``ids``, the prompts and every new token up to ``token``), called as transformers' ``generate`` calls a
    ``StoppingCriteriaList`` (``scores`` None: a stop string's ``StopStringCriteria`` reads the ids alone)."""
    done = ended(token, eos_token_id)
    if stopping_criteria is not None:
        done = done | stopping_criteria(ids, None).to(done.device)
    return done


def gumbel(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    uniform = torch.rand(rows, vocab, generator=generator, dtype=torch.float32).clamp_(min=torch.finfo().tiny)
    return -torch.log(-torch.log(uniform))


def decode(
    forward: Callable[..., torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: slice,
    total_rows: int, *, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
    eos_token_id: int | Sequence[int] | None, pad_token_id: int, all_done: Callable[[bool], bool], width: int = 1,
    stopping_criteria: Criteria | None = None, position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoding loop over ``rows`` of a global batch of ``total_rows``: ``forward(ids, mask, positions, pads)``
    (which holds the KV cache) gives the full-vocabulary logits of the position before the last ``pads`` and drops
    those from the cache (``drop_pads``); ``all_done(mine)`` whether every rank's rows are done.

    ``width``: every forward's sequence a multiple of it (sequence parallelism splits a forward's tokens over its
    tp ranks). The prompts get that many more left pads, and each new token is followed by ``width - 1`` masked
    pads, which the cache drops after the forward: no query sees a pad (their mask is 0; a later one is past the
    token, which causal attention hides) and their outputs are dropped, and the cache holds the real tokens only, so
    a sliding window (Gemma's, Mistral's: it counts cache entries) covers the tokens it covers at width 1 (pads
    before the token filled the window: Gemma 3's window of 6 saw 3 tokens at tp=2) and the tokens are width 1's."""
    generator = torch.Generator().manual_seed(seed)
    step_ids, mask, positions = first_inputs(input_ids, attention_mask, pad_token_id, width, position_ids)
    logits = forward(step_ids, mask, positions, 0)
    ids = input_ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for step in range(max_new_tokens):
        noise = gumbel(generator, total_rows, logits.shape[-1])[rows].to(logits.device) if temperature > 0 \
            else None
        token = pick(logits.float(), noise, temperature, top_k, top_p)
        token = token.masked_fill(done, pad_token_id)
        ids = torch.cat([ids, token[:, None]], dim=1)
        done |= rows_ended(ids, token, eos_token_id, stopping_criteria)
        if step == max_new_tokens - 1 or all_done(bool(done.all())):  # every rank alike; no forward after the last
            break
        step_ids, mask, positions = next_inputs(token, mask, positions, pad_token_id, width)
        logits = forward(step_ids, F.pad(mask, (0, width - 1)), positions, width - 1)
    return ids


def first_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int, width: int,
                 position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts' forward: ids, mask and positions, left padded to a multiple of ``width`` (masked pads);
    ``position_ids``: the prompts' own ([3, rows, length]: an M-RoPE model's, from its ``get_rope_index``), else
    counted along the mask."""
    extra = -input_ids.shape[1] % width
    mask = F.pad(attention_mask, (extra, 0))
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0) if position_ids is None else \
        F.pad(position_ids, (extra, 0), value=1)
    return F.pad(input_ids, (extra, 0), value=pad_token_id), mask, positions


def next_inputs(token: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, pad_token_id: int, width: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's forward after ``token`` [rows]: it, then ``width - 1`` pads; the mask of the cache's entries grown by
    the token (the step's forward masks the pads after it: ``F.pad(mask, (0, width - 1))``); the positions one on."""
    ids = F.pad(token[:, None], (0, width - 1), value=pad_token_id)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids, mask, (positions[..., -1:] + 1).expand(*positions.shape[:-1], width)  # M-RoPE's 3 alike


def drop_pads(logits: torch.Tensor, cache: DynamicCache, pads: int) -> torch.Tensor:
    """The logits [rows, positions, ...] of the position before the last ``pads`` (a step's token), and the cache
    without those pads' entries (``decode``'s ``width``)."""
    cache.crop(-pads)  # transformers' crop: a negative count of entries to remove from the end (0: none)
    return logits[:, -1 - pads]


class StageCache(DynamicCache):
    """transformers' DynamicCache for the decoder layers from ``first_layer`` on: the model reads the cache's length
    (positions, the mask's size) from layer 0's entry by default, which a later pipeline stage never fills; this one
    answers for a layer before ``first_layer`` with ``first_layer``'s (at 0: a DynamicCache)."""

    def __init__(self, first_layer: int = 0) -> None:
        super().__init__()
        self.first_layer = first_layer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(max(layer_idx, self.first_layer))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, max(layer_idx, self.first_layer))
