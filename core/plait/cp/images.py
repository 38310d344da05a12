"""An image-text model's forward under context parallelism: the images whole, the language model on its slice.

The model embeds the whole sequence and merges the image features into it (every cp rank runs the vision tower on
its rows' images; their gradients sum over the replica group); its language model (transformers' ``get_decoder``)
then gets this rank's slice of the merged embeddings. Only the language model runs as a cp forward: the vision
tower builds its own masks (Idefics3's patch mask, bidirectional over its patches) and attends with its own
attention over whole images, so the cp sequence is suspended until the language model starts. A model whose
rotary positions follow its images' grids (M-RoPE) gets this rank's slice of the positions its own
``get_rope_index`` gives the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from plait.cp.context import ContextParallel
from plait.cp.sequence import current, enter, leave


@contextlib.contextmanager
def text_model_takes_its_tokens(model: nn.Module, cp: ContextParallel,
                                grid_positions: torch.Tensor | None = None) -> Iterator[None]:
    """Inside a cp forward (``ContextParallel.forward``): the vision tower and the merge run as without cp, the
    language model on this rank's slice of the embeddings (and of ``grid_positions``, [3, rows, seq])."""
    text = model.get_decoder()  # transformers' name for the language model of a composite
    sequence = current()
    inside: list = []

    def start(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inside.append(enter(sequence))
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = cp.take(kwargs["inputs_embeds"])
        if grid_positions is not None:
            kwargs["position_ids"] = cp.take(grid_positions, dim=2)
        return args, kwargs

    def end(module: nn.Module, args: tuple, output: object) -> None:
        leave(inside.pop())

    outside = enter(None)  # the whole model's forward but its language model: no cp sequence
    handles = [text.register_forward_pre_hook(start, with_kwargs=True),
               text.register_forward_hook(end, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        leave(outside)
