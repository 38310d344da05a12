"""Decoding under pipeline parallelism with the pipeline full: the prompts cut into micro-batches that follow one
another through the stages, step after step.

A stage holds some of the decoder layers, so a token's forward visits every stage in turn; decoding the whole batch
at once would keep one stage busy and the others waiting. Here each replica's rows are cut into ``micro``
micro-batches (as many as stages, where there are rows enough), each with its own KV cache on every stage, and every
stage runs them in the same order: step 0 of micro-batches 0, 1, ..., then step 1 of each, and so on. Stage s sends
each micro-batch's hidden states to stage s + 1 (point to point, without waiting for delivery); the last stage picks
the micro-batch's token and sends it back to every other stage, where it is the input of that micro-batch's next step
(the first stage's, and the ids later stages read). With as many micro-batches as stages, a micro-batch's token is
back at the first stage when its turn comes again, so in the steady state every stage works at once: each forward
costs a stage 1/micro of the batch's work, which pays wherever the work grows with the rows (the prompts' forward,
larger batches) and costs nothing where it does not (a small batch's decoding reads each stage's weights per forward
either way).

Every rank runs the same forwards (tp, ep and ZeRO-3's collectives run inside them): whether a step runs is decided
on the last stage and travels with the tokens. Its decision for step t + 1 is sent with step t's first token, before
step t is complete, so it rests on step t - 1: every row of every replica done then (an all-reduce over the last
stages' dp and cp groups), or ``max_new_tokens`` reached. A batch that finishes at step t so runs one step more,
whose tokens are dropped: the result is ``decode``'s. Sampling is ``decode``'s too: the last stage draws each step's
noise for the whole global batch from the seed and gives each micro-batch its rows' part, so the tokens are one
process's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.base.images import ImageBatch
from plait.base.mesh import Mesh
from plait.generation.decode import (Criteria, StageCache, drop_pads, first_inputs, gumbel, next_inputs, pick,
                                    rows_ended)
from plait.generation.images import PromptImages


HIDDEN, TOKENS = 1, 2  # the tags of the two kinds of message (two may travel between the same ranks)


@dataclass(frozen=True)
class StageLink:
    """This rank's stages (ascending) of ``stages``, placed looped over the ``pp`` ranks of ``group`` (stage s on
    pipeline rank s % pp, as the training schedules place them)."""

    mine: tuple[int, ...]
    stages: int
    pp: int
    group: dist.ProcessGroup

    def peer(self, stage: int) -> int:
        """The global rank holding ``stage`` in this rank's pipeline."""
        return dist.get_global_rank(self.group, stage % self.pp)

    @property
    def last(self) -> int:
        return self.stages - 1


@dataclass
class _Part:
    """One micro-batch's state on a stage: the step's ids, the mask and positions so far, its tokens, its done rows,
    its prompts."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    noise_rows: slice
    tokens: list[torch.Tensor]
    done: torch.Tensor
    prompts: torch.Tensor  # the rows' prompts as given (what a stopping criterion reads, with the tokens)


def micro_rows(rows: int, micro: int) -> list[slice]:
    """The rows of each of ``micro`` micro-batches of a replica's ``rows`` (``Tensor.tensor_split``'s cut), the one
    cut the stages' images and the decoding's state both follow."""
    return [slice(int(r[0]), int(r[-1]) + 1) for r in torch.arange(rows).tensor_split(micro)]


def decode_stages(chunks: list[Any], mesh: Mesh, module: nn.Module,
                  gather_logits: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                  attention_mask: torch.Tensor, rows: slice, total: int, extra: dict[str, Any], cache_name: str,
                  images: ImageBatch | None = None, **settings: Any) -> torch.Tensor:
    """``ParallelModel.generate`` under pipeline parallelism, on this rank's stage ``chunks`` of ``module``: the
    replica's rows in as many micro-batches as pipeline ranks (where it has rows enough), each with its own KV cache
    on each of this rank's stages; ``gather_logits`` joins the vocab-parallel head's slices. ``images``: the replica's
    rows' image inputs, each micro-batch's given to its prompts' forward on every stage (``PromptImages``)."""
    micro = min(len(input_ids), mesh.pp)
    caches = [[StageCache(chunk.first_layer) for _ in range(micro)] for chunk in chunks]
    prompts = [[PromptImages(images, part, chunk.is_first) for part in micro_rows(len(input_ids), micro)]
               for chunk in chunks]
    dtype = next(module.parameters()).dtype  # what a decoder layer hands on
    hidden = module.config.get_text_config().hidden_size

    def run(v: int, m: int, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
            pads: int) -> torch.Tensor:
        keep = {"logits_to_keep": pads + 1} if "logits_to_keep" in extra else {}
        out = chunks[v].decode_step(x, mask, positions, ids, **{**extra, **keep}, **{cache_name: caches[v][m]},
                                    **prompts[v][m].take(ids))
        out = out[0] if isinstance(out, tuple) else out
        if chunks[v].is_last:
            return gather_logits(drop_pads(out, caches[v][m], pads)).float()
        caches[v][m].crop(-pads)  # the stage's cache without the step's pads (its hidden states keep them)
        return out.contiguous()

    def receive_buffer(v: int, ids: torch.Tensor) -> torch.Tensor:
        return ids.new_empty((ids.shape[0], ids.shape[1] // chunks[v].seq_shards, hidden), dtype=dtype)

    link = StageLink(tuple(chunk.stage for chunk in chunks), mesh.pp * mesh.config.virtual_pipeline_size, mesh.pp,
                     mesh.pp_group)
    return decode_pipelined(run, receive_buffer, link, input_ids, attention_mask, rows, total, micro, **settings)


def decode_pipelined(
    run: Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    receive_buffer: Callable[[int, torch.Tensor], torch.Tensor], link: StageLink, input_ids: torch.Tensor,
    attention_mask: torch.Tensor, rows: slice, total_rows: int, micro: int, *, max_new_tokens: int,
    temperature: float, top_k: int, top_p: float, seed: int, eos_token_id: int | Sequence[int] | None,
    pad_token_id: int, all_done: Callable[[bool], bool], width: int = 1, stopping_criteria: Criteria | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``decode`` on one rank of a pipeline: ``run(v, m, x, mask, positions, ids, pads)`` is the forward of this rank's
    ``v``-th stage on micro-batch ``m`` (their own KV cache, without the last ``pads`` entries after it: decode's
    ``width``): the hidden states to send on, or on the last stage the full-vocabulary logits before the pads;
    ``receive_buffer(v, ids)`` an empty tensor for the hidden states the ``v``-th stage gets for a step's ``ids``;
    ``all_done(mine)`` (called where the last stage is only) whether every replica's rows are done. A rank of several
    stages runs its first stage on every micro-batch, then its second, and so on. Returns [rows, prompt + new] on every
    rank."""
    ids, mask, positions = first_inputs(input_ids, attention_mask, pad_token_id, width, position_ids)
    parts = [_Part(ids[r], mask[r], positions[..., r, :], slice(rows.start + r.start, rows.start + r.stop), [],
                   torch.zeros(r.stop - r.start, dtype=torch.bool), input_ids[r])
             for r in micro_rows(len(input_ids), micro)]  # positions by rows: M-RoPE's are [3, rows, tokens]
    generator = torch.Generator().manual_seed(seed)
    last = link.last in link.mine
    others = [r for r in range(link.pp) if r != link.last % link.pp]  # the ranks the tokens go to
    steps, finished, stopping, go_next = 0, None, False, True
    for step in range(max_new_tokens):
        noise, sent = None, []
        for v, stage in enumerate(link.mine):
            for m, part in enumerate(parts):
                if v == 0 and step > 0 and not _next_input(part, link, last, pad_token_id, width):
                    return _result(input_ids, parts, link, finished or steps)  # the last stage said step stops
                x = part.ids if stage == 0 else receive_buffer(v, part.ids)
                if stage > 0:
                    dist.recv(x, link.peer(stage - 1), group=link.group, tag=HIDDEN)
                pads = 0 if step == 0 else width - 1  # decode's: the pads after a step's token
                out = run(v, m, x, F.pad(part.mask, (0, pads)), part.positions, part.ids, pads)
                if stage != link.last:  # on to the next stage while this one runs the next micro-batch
                    sent.append((dist.isend(out, link.peer(stage + 1), group=link.group, tag=HIDDEN), out))
                    continue
                if temperature > 0 and noise is None:  # the step's noise for the whole global batch, as decode's
                    noise = gumbel(generator, total_rows, out.shape[-1])
                token = pick(out.float(), None if noise is None else noise[part.noise_rows], temperature, top_k, top_p)
                token = token.masked_fill(part.done, pad_token_id)
                part.tokens.append(token)
                so_far = None if stopping_criteria is None else torch.cat([part.prompts, *(t[:, None] for t in
                                                                                      part.tokens)], 1)
                part.done |= rows_ended(so_far, token, eos_token_id, stopping_criteria)
                if m == 0:  # whether step + 1 runs, on what is known now: every replica's rows at step - 1
                    go_next = step + 1 < max_new_tokens and not stopping
                if step + 1 < max_new_tokens and (go_next or m == 0):  # the token, and the word to go on or stop
                    message = torch.cat([token, torch.tensor([int(go_next)])])
                    sent += [(dist.isend(message, dist.get_global_rank(link.group, r), group=link.group, tag=TOKENS),
                              message) for r in others]
        for work, _ in sent:
            work.wait()
        steps = step + 1
        if last:
            stopping = all_done(all(bool(p.done.all()) for p in parts))
            if stopping and finished is None:
                finished = steps
            if not go_next:
                break
    return _result(input_ids, parts, link, finished or steps)


def _next_input(part: _Part, link: StageLink, last: bool, pad_token_id: int, width: int) -> bool:
    """Make the micro-batch's previous token its next input (from the last stage, unless this is it); False where
    the last stage said the step does not run."""
    token = part.tokens[-1] if last else None
    if not last:
        message = part.ids.new_empty(len(part.ids) + 1)
        dist.recv(message, link.peer(link.last), group=link.group, tag=TOKENS)
        if not message[-1]:
            return False
        token = message[:-1]
        part.tokens.append(token)
    part.ids, part.mask, part.positions = next_inputs(token, part.mask, part.positions, pad_token_id, width)
    return True


def _result(input_ids: torch.Tensor, parts: list[_Part], link: StageLink, steps: int) -> torch.Tensor:
    """The prompts with the last stage's new tokens (its first ``steps``: the other stages may not know where the
    batch finished), on every stage."""
    count = torch.tensor([steps])
    dist.broadcast(count, link.peer(link.last), group=link.group)
    new = input_ids.new_empty((len(input_ids), int(count)))
    if link.last in link.mine:
        new = torch.cat([torch.stack(p.tokens[:steps], dim=1) for p in parts])
    dist.broadcast(new, link.peer(link.last), group=link.group)
    return torch.cat([input_ids, new], dim=1)
