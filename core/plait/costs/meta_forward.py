"""A causal LM's training forward on the meta device, for the planner's trace (``activations.trace_activations``).

The meta device holds shapes, not values. transformers' mask helpers read values only to pick a faster path: an
all-ones padding mask lets sdpa run causal without a mask (``fast_all``), and positions are searched for packed
sequences (``find_packed_sequence_indices``, where a model passes its own ``position_ids``: Gemma 4, Moshi). The
trace's row is one unpadded, unpacked sequence, which is what they would find, so on meta tensors they are told
so; tensors the forward makes without naming a device (XLNet's relative positions) are made there too. A
forward that still needs values (attention that selects tokens by value, Qwen4-exp's; a model that slices by
a count it computes) or a device (XLNet's tensors made on the CPU), or that fails text-only (Llama 4's image-text
class reads image outputs it did not make), cannot be traced: it is refused in one line naming
the model and the line of transformers' code that failed, with the way to size the run instead.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from plait.base.config import ConfigError


def forward_on_meta(model: nn.Module, ids: torch.Tensor) -> Any:
    """``model(input_ids=ids, labels=ids)`` with ``ids`` on the meta device (module docstring)."""
    from transformers import masking_utils

    fast_all, packed = masking_utils.fast_all, masking_utils.find_packed_sequence_indices
    try:
        with torch.device(ids.device), \
                mock.patch.object(masking_utils, "fast_all", lambda t: True if t.is_meta else fast_all(t)), \
                mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                  lambda p: None if p.is_meta else packed(p)):
            return model(input_ids=ids, labels=ids)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001  (whatever the model's own code raises there: named, in one line)
        frames = traceback.extract_tb(err.__traceback__)
        frames = [f for f in frames if "/transformers/" in f.filename] or frames[-1:]
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        message = " ".join(str(err).split())[:160]
        raise ConfigError(
            f"plait plan traces {model.config.model_type} on the meta device (shapes without values), where its "
            f"forward fails ({type(err).__name__}{where}: {message}); size the run with plait train "
            f"--max_steps 2") from err
