"""Batched, KV-cached decoding from a laid-out model's own shards (issue 48's first piece).

Every rank passes the same global batch of prompts (left padded, with their attention mask); each data-parallel
replica decodes its contiguous rows, the tp ranks of a replica together: each holds its heads' keys and values in
transformers' own cache (its attention layers run on their local heads) and the vocab-parallel head's slices are
joined into the full logits before a token is picked. The result is the whole batch's, on every rank.

Sampling is the same in every layout and in one process: a step's noise is drawn for the whole global batch from
one generator seeded with ``seed`` (every rank draws the same), each replica taking its rows' part; a token is the
argmax of the filtered, tempered logits plus Gumbel noise, which samples the softmax (the Gumbel-max trick).
Temperature 0 is greedy: transformers' ``generate`` on one process, token for token.

Every rank runs the same number of forwards (tp, ep and ZeRO-3's collectives run inside them): decoding stops when
every row of the global batch has met EOS, or after ``max_new_tokens``.

Held to one process (tests/test_generate.py): tp without sequence parallelism, data parallelism, ZeRO-1/2/3, expert
parallelism (each replica's rows dispatched to the experts' ranks in every forward). Refused by name, before any
collective: sequence parallelism (a decode step's one token cannot be split over tp ranks), pp and cp. LoRA runs
through the same forwards but is not held to one process yet.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from plait.base import comm
from plait.base.config import ConfigError
from plait.checkpoint.gather import gather_logits
from plait.parallelize import ParallelModel


def check_layout(pmodel: ParallelModel, batch: int) -> None:
    """One line for a layout or batch generation does not serve yet; nothing has run."""
    config, mesh = pmodel.config, pmodel.mesh
    if config.sequence_parallel:
        raise ConfigError(f"generation under sequence parallelism (tp={config.tp}) is not served: a decode step's one "
                          f"token cannot be split over {config.tp} ranks; lay the model out with sp=False "
                          f"(--disable_sequence_parallel)")
    for name, size in (("pp", config.pp), ("cp", config.cp)):
        if size > 1:
            raise ConfigError(f"generation with {name}={size} is not served yet; use a layout with {name}=1")
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


def gumbel(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    uniform = torch.rand(rows, vocab, generator=generator, dtype=torch.float32).clamp_(min=torch.finfo().tiny)
    return -torch.log(-torch.log(uniform))


def decode(
    forward: Callable[..., torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: slice,
    total_rows: int, *, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
    eos_token_id: int | None, pad_token_id: int, all_done: Callable[[bool], bool],
) -> torch.Tensor:
    """The decoding loop over ``rows`` of a global batch of ``total_rows``: ``forward(ids, mask, positions, cache)``
    gives the last position's full-vocabulary logits; ``all_done(mine)`` whether every rank's rows are done."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    ids, mask = input_ids, attention_mask
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = forward(ids, mask, positions, cache)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for step in range(max_new_tokens):
        noise = gumbel(generator, total_rows, logits.shape[-1])[rows].to(logits.device) if temperature > 0 \
            else None
        token = pick(logits.float(), noise, temperature, top_k, top_p)
        token = token.masked_fill(done, pad_token_id)
        ids = torch.cat([ids, token[:, None]], dim=1)
        if eos_token_id is not None:
            done |= token == eos_token_id
        if step == max_new_tokens - 1 or all_done(bool(done.all())):  # every rank alike; no forward after the last
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        logits = forward(token[:, None], mask, positions, cache)
    return ids


def generate(
    pmodel: ParallelModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
    max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
    eos_token_id: int | None = None, pad_token_id: int = 0,
) -> torch.Tensor:
    """Prompts [batch, length] (the global batch, the same on every rank; left padded where ``attention_mask`` has
    zeros) and their completions: [batch, length + new], padded with ``pad_token_id`` after a row's EOS."""
    check_layout(pmodel, input_ids.shape[0])
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mesh, module = pmodel.mesh, pmodel.module
    per = input_ids.shape[0] // mesh.dp
    rows = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
    world = comm.world_group()

    # the head on the last position only, as transformers' generate asks: a prompt's other positions need no logits
    # (32 of them cost a tenth of a 125M model's decoding); where the model's forward takes the argument. The cache
    # under the name the forward takes: ``cache`` (transformers 5.24, which warns at ``past_key_values``) or the older
    arguments = inspect.signature(type(module).forward).parameters
    last = {"logits_to_keep": 1} if "logits_to_keep" in arguments else {}
    cache_name = "cache" if "cache" in arguments else "past_key_values"

    def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        out = pmodel._model(ids, mask, positions, use_cache=True, **{cache_name: cache}, **last)
        return gather_logits(pmodel, out.logits[:, -1])

    def all_done(mine: bool) -> bool:
        return comm.all_reduce(torch.tensor([0 if mine else 1]), world).item() == 0

    training = module.training
    module.eval()  # no dropout; the model's own mode given back after
    try:
        with torch.no_grad():
            ids = decode(forward, input_ids[rows], attention_mask[rows], rows, input_ids.shape[0],
                         max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id, all_done=all_done)
    finally:
        module.train(training)
    return comm.all_gather(ids, mesh.dp_group, dim=0)
