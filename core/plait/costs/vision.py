"""The vision tower's share of an image-text-to-text model's step: its activations and FLOPs per image.

The decoder's cost is per token; the vision tower's (and its projector's) is per image: it runs on each image's
patches, whatever the text around it. So ``plait plan --images_per_sample N`` traces the tower once, on the meta
device, on one image as the model's own processor prepares it (a 512x512 picture, resized and cut as the
processor does): what autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``, parameters left
out, a storage counted once) and the forward's matmul FLOPs (``torch.utils.flop_counter``). Both scale with the
images of a micro-batch. The tower and projector are whole on every tp rank and run on the first pipeline stage
(plait's layout for them), so their bytes are not split by tp; their weights run per image, not per token, and
leave the decoder's per-token FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from plait.base.config import ConfigError


@dataclass(frozen=True)
class VisionTrace:
    """Per image: the bytes saved for backward and the forward's matmul FLOPs; ``images`` a sample;
    ``modules``: the vision tower's and projector's names."""

    images: int
    saved_bytes: int
    flops: float
    modules: tuple[str, ...]

    def runs_in(self, param_name: str) -> bool:
        return any(param_name.startswith(f"{module}.") for module in self.modules)


def trace_vision(model: nn.Module, pixels: dict[str, torch.Tensor], images: int, modules: tuple[str, ...],
                 squares: bool = False) -> VisionTrace:
    """Run ``model``'s image features (on the meta device) for the one image of ``pixels`` (its processor's
    tensors) and record what it saves and computes. ``squares``: attention keeps its n x n probabilities (eager,
    or sdpa's math path: the decoder's trace says which, ``ActivationTrace.squares``); the meta device runs sdpa's
    math path, which saves them, where a fused kernel keeps only its output and log-sum-exp."""
    features = getattr(model, "get_image_features", None)
    if features is None:
        raise ConfigError(f"--images_per_sample: {type(model).__name__} has no get_image_features to trace its "
                          f"vision tower with; drop it")
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: set[int] = set()
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        square = tensor.dim() >= 3 and tensor.shape[-1] == tensor.shape[-2] > 1 and tensor.is_floating_point()
        if key not in params and key not in seen and (squares or not square):
            seen.add(key)
            saved[0] += tensor.untyped_storage().nbytes()
        return tensor

    inputs = {name: value.to("meta") for name, value in pixels.items()}
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as counter:
        out = features(**inputs)  # held: its graph holds what backward would find
    del out
    return VisionTrace(images, saved[0], float(counter.get_total_flops()), modules)
