"""Which rows of a global batch each data-parallel rank trains at each micro-step: one rule for the trainer's
sampler and for a user's own loop (``ParallelModel.local_batch``), so both see the same tokens on every layout."""

from __future__ import annotations

import torch

from plait.base.config import ConfigError


def local_microbatch(
    global_indices: torch.LongTensor,
    dp_rank: int,
    dp_size: int,
    accumulation_steps: int,
    micro_step: int,
) -> torch.LongTensor:
    """Return the slice of a global batch for one data-parallel rank and micro-step.

    The global batch is split into ``accumulation_steps`` contiguous micro-steps,
    and each micro-step into ``dp_size`` contiguous rank slices. Together the
    slices cover the global batch exactly once, so the same global batch (and,
    up to float rounding, the same update) is trained whatever the dp size and
    accumulation.

    Raises:
        ValueError: if the global batch does not divide evenly, or the rank or
            micro-step is out of range.
    """
    global_batch_size = global_indices.numel()
    if dp_size < 1 or accumulation_steps < 1:
        raise ValueError(f"dp_size={dp_size} and accumulation_steps={accumulation_steps} must be positive")
    if global_batch_size % (dp_size * accumulation_steps) != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by "
            f"dp_size * accumulation_steps = {dp_size} * {accumulation_steps} = {dp_size * accumulation_steps}; "
            f"use a global batch of a multiple of {dp_size * accumulation_steps} rows"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is out of range for dp_size={dp_size}")
    if not 0 <= micro_step < accumulation_steps:
        raise ValueError(f"micro_step={micro_step} is out of range for accumulation_steps={accumulation_steps}; "
                         f"use 0 to {accumulation_steps - 1}")
    per_rank = global_batch_size // (dp_size * accumulation_steps)
    start = (micro_step * dp_size + dp_rank) * per_rank
    return global_indices[start : start + per_rank]


def check_batch_shapes(input_ids: torch.Tensor, vocab: int | None = None, **others: torch.Tensor | None) -> None:
    """``input_ids`` is [batch, sequence], and the labels and the [batch, sequence] mask given beside it are of its
    shape (a 4-D mask is transformers' own to check): a mismatch (labels of the global batch beside a rank's ids,
    1-D ids) is named here, before a collective, where torch named flattened token counts inside the loss.
    ConfigError naming the shapes and the fix. With ``vocab``, the ids are checked against it too
    (``check_token_range``)."""
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids of shape {tuple(input_ids.shape)} must be [batch, sequence]; add the batch "
                         f"dimension (input_ids[None] for one sequence)")
    for name, tensor in others.items():
        if tensor is not None and (name == "labels" or tensor.dim() == 2) and tensor.shape != input_ids.shape:
            raise ConfigError(f"{name} of shape {tuple(tensor.shape)} does not match input_ids of shape "
                             f"{tuple(input_ids.shape)}; pass the same rows of each (ParallelModel.local_batch on "
                             f"every one of them)")
    if vocab is not None:
        check_token_range(vocab, ids=input_ids)


def check_token_range(vocab: int, ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> None:
    """Refuse ids, and labels other than the ignored -100, outside [0, ``vocab``). One process's embedding and loss
    raise an IndexError there, but split over tp a rank reads only its own rows: an id past the vocabulary was a
    zero embedding and a label past it a zero target logit, trained on without a word (an audit: a tokenizer with
    added tokens beside a model never resized). Asserted on the device, without waiting for it (an accelerator
    raises at its next synchronisation), every rank alike: the ranks of a tp group hold the same batch. Labels are
    checked by the causal-LM loss itself: other objectives carry more than token ids in theirs (DPO's packed pairs)."""
    bad = torch.zeros((), dtype=torch.bool, device=(ids if ids is not None else labels).device)
    if ids is not None:
        bad = bad | ((ids < 0) | (ids >= vocab)).any()
    if labels is not None:
        bad = bad | ((labels != -100) & ((labels < 0) | (labels >= vocab))).any()
    message = (f"token ids or labels outside the model's vocabulary of {vocab} (ids 0 to {vocab - 1}; labels those or "
               f"-100): a tokenizer with tokens the model has no row for? resize the model's embeddings "
               f"(model.resize_token_embeddings(len(tokenizer))) before parallelize")
    try:
        torch._assert_async(~bad, message)
    except NotImplementedError:  # a backend without the kernel (CPU and CUDA have it): checked on the host
        if bad.item():
            raise RuntimeError(message) from None
