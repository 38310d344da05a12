"""Visual tokens added again after the language model's first layers (Qwen3-VL's "deepstack"), where each rank holds
a slice of the sequence.

Qwen3-VL and its kin hand their language model, beside the merged embeddings, ``visual_pos_masks`` ([rows, seq]:
where the image tokens are) and ``deepstack_visual_embeds`` (one [image tokens, hidden] tensor per vision layer
listed in ``deepstack_visual_indexes``); after decoder layer i the model adds the i-th to the hidden states at the
masked positions. Under sequence parallelism the hidden states between layers are this tp rank's shard of the
sequence, and under context parallelism this cp rank's tokens: the mask and the embeddings are cut to the same
tokens here, before the language model runs. The embeddings are spread over the whole sequence first, so the cut
is the one the hidden states get: cp's ``take`` (its gradient reaches the vision tower on each cp rank, summed over
the replica group as the vision tower's are) and SP's scatter (whose backward gathers the whole sequence's
gradient on every tp rank, where the vision tower is whole). Under pp only the first stage runs the vision tower:
the deepstack layers must be its own, and not its last (the stage sends its last layer's output, before the model
adds to it: ``check_pipeline``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from plait.base.config import ConfigError
from plait.base.images import ImageBatch, image_layouts_besides, pipeline_unseen
from plait.tp import mappings


def deepstack_layers(model: nn.Module) -> int:
    """How many of the language model's first layers get visual tokens added after them: one per vision layer of
    ``deepstack_visual_indexes`` the vision tower has (0: none, or a language model that takes no
    ``deepstack_visual_embeds``)."""
    text = model.get_decoder()
    if "deepstack_visual_embeds" not in inspect.signature(text.forward).parameters:
        return 0
    vision = getattr(model.config, "vision_config", None)
    depth = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", None)
    return sum(depth is None or i < depth for i in getattr(vision, "deepstack_visual_indexes", None) or ())


def check_pipeline(model: nn.Module, layers: list[str], first_stage_layers: int, sliced: bool) -> None:
    """Refuse a pipeline whose first stage does not hold every layer the visual tokens are added after (``layers``:
    the decoder layers' names, for the cut to give), or whose stages hold slices of the sequence (``sliced``: SP or
    cp; the first stage's model is a shell of its own)."""
    wanted = deepstack_layers(model)
    if wanted and sliced:
        raise ConfigError(f"image inputs under pp with sequence or context parallelism: {type(model).__name__} adds "
                          f"visual tokens after its first {wanted} decoder layers, which plait cuts to a rank's slice "
                          f"of the sequence without pp only; disable sequence parallelism and use cp=1, or pp=1")
    if wanted >= first_stage_layers:  # what is added after the stage's last layer would not be sent on
        fix = (f"start the second stage at {layers[wanted + 1]} or later (pipeline_cuts)" if wanted + 1 < len(layers)
               else "its decoder is too short to stage after them; use pp=1")
        raise ConfigError(f"image inputs under pp: {type(model).__name__} adds visual tokens after its first {wanted} "
                          f"decoder layers, inside its first pipeline stage only, which holds {first_stage_layers}; "
                          f"{fix}")


def check_image_stages(model: nn.Module, layers: list[str], first_stage_layers: int, pp: int, sliced: bool,
                       images: ImageBatch | None = None) -> None:
    """Under pp, what the stages after the first would not get of an image-text model's inputs, training and
    generation alike: positions only the first stage could compute (``pipeline_unseen``), visual tokens added after
    layers past the first stage (``check_pipeline``). With ``images`` None what the model alone tells, as the trainer
    and ``plait generate`` ask on the meta model and the planned stages before any process group."""
    unseen = pipeline_unseen(model, images)
    if unseen:
        raise ConfigError(f"image inputs under pp={pp}: {type(model).__name__.removeprefix('FSDP')}'s later stages "
                          f"would not see {unseen}, which only the first stage gets; use "
                          f"{image_layouts_besides(model.config, 'pp')} for it")
    check_pipeline(model, layers, first_stage_layers, sliced)


@contextlib.contextmanager
def deepstack_on_local_tokens(model: nn.Module, take: Callable[[torch.Tensor], torch.Tensor] | None,
                              sp_group: dist.ProcessGroup | None) -> Iterator[None]:
    """While the model runs: its language model gets the visual tokens of this rank's slice of the sequence
    (``take``: cp's, None without cp; ``sp_group``: the tp group under sequence parallelism, else None)."""
    if (take is None and sp_group is None) or not deepstack_layers(model):  # the cheap question first
        yield
        return

    def local(mask: torch.Tensor, spread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if take is not None:
            mask, spread = take(mask), take(spread)
        if sp_group is not None:  # the mask as [rows, seq, 1]: the scatter cuts the hidden states' sequence dimension
            mask = mappings.scatter_to_seq(mask[..., None], sp_group)[..., 0]
            spread = mappings.scatter_to_seq(spread, sp_group)
        return mask, spread

    def cut(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask, embeds = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
        if mask is None or not embeds:
            return args, kwargs
        mine = []
        for embed in embeds:  # over the whole sequence (zeros off the image tokens), then this rank's tokens
            spread = embed.new_zeros(*mask.shape, embed.shape[-1]).index_put((mask,), embed)
            local_mask, local_spread = local(mask, spread)
            mine.append(local_spread[local_mask])
        kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = local_mask, mine
        return args, kwargs

    handle = model.get_decoder().register_forward_pre_hook(cut, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
