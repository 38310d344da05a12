"""An image-text model's forward under context parallelism: the images whole, the language model on its slice.

The model embeds the whole sequence and merges the image features into it (every cp rank runs the vision tower on
its rows' images; their gradients sum over the replica group); its language model (transformers' ``get_decoder``)
then gets this rank's slice of the merged embeddings. The vision tower and projector run outside the cp forward:
they build their own masks (Idefics3's patch mask, bidirectional over its patches) and attend with their own
attention over whole images, so the cp sequence is suspended while they run. The rest of the model's own forward
runs inside it: a model that builds its language model's masks there (Gemma 4's, over the whole merged sequence)
gets them for the whole sequence, as its language model would build them. A model whose
rotary positions follow its images' grids (M-RoPE) gets this rank's slice of the positions its own
``get_rope_index`` gives the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from plait.base.meta import before_language_model, language_model_name
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
        for name, value in kwargs.items():  # the merged embeddings, and what else per token the model made of them
            if torch.is_tensor(value) and value.is_floating_point() and value.dim() >= 2 and \
                    value.shape[1] == sequence.seq and (name == "inputs_embeds" or value.dim() >= 3):
                kwargs[name] = cp.take(value)  # (Gemma 4's per_layer_inputs [rows, seq, layers, width])
        if grid_positions is not None:
            kwargs["position_ids"] = cp.take(grid_positions, dim=2)
        return args, kwargs

    def end(module: nn.Module, args: tuple, output: object) -> None:
        leave(inside.pop())

    def suspend(module: nn.Module, args: tuple) -> None:
        inside.append(enter(None))

    handles = [text.register_forward_pre_hook(start, with_kwargs=True),
               text.register_forward_hook(end, always_call=True)]
    for module in image_modules(model):  # no cp sequence while they run on the images
        handles += [module.register_forward_pre_hook(suspend), module.register_forward_hook(end, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def image_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules of an image-text ``model`` that run on the images before its language model (its
    vision tower and projector: ``before_language_model``), not those holding the language model."""
    runs_on_images, decoder = before_language_model(model), language_model_name(model) or ""
    names = [name for name, _ in model.named_modules()
             if name and runs_on_images(name) and not decoder.startswith(name + ".")]
    return [model.get_submodule(name) for name in names
            if not any(name.startswith(other + ".") for other in names)]
