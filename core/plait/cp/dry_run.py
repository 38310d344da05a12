"""One forward of a copy of a meta model with context parallelism installed: refusals found before launch.

Most of what cp cannot do is visible in the model's structure (plait.cp.layout). Model code that uses the
attention mask itself before handing it to the attention function (Doge's dynamic mask adds learned scores
to it) is visible only by running it: a forward of a short sequence on the meta device, on a copy of the
model (a meta copy costs no memory), with the cp implementation installed on a group of one rank. A
``MaskRead`` there is a refusal naming the file and line; any other error is not cp's (meta tensors do not
run data-dependent code such as MoE routing) and leaves the question to the conformance kit.
"""

from __future__ import annotations

import copy
import traceback
from pathlib import Path

import torch
from torch import nn

from plait.config import ConfigError
from plait.cp.attention import install_context_parallel
from plait.cp.context import ContextParallel
from plait.cp.layout import CPPlan
from plait.cp.masks import MaskRead

SEQ = 8


def check_on_meta(model: nn.Module) -> None:
    """Raise ConfigError when ``model`` (on the meta device; others are not run) reads the cp mask itself."""
    if not all(p.is_meta for p in model.parameters()):
        return
    shadow = copy.deepcopy(model)
    cp = ContextParallel(None, 0, CPPlan(1, "all-to-all", None, None), install_context_parallel(shadow))
    ids = torch.zeros((1, SEQ), dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), cp.forward(1, SEQ, None, None, ids.device) as local:
            shadow(input_ids=ids, use_cache=False, **local)
    except MaskRead as err:
        frame = next((f for f in reversed(traceback.extract_tb(err.__traceback__)) if "cp/masks.py" not in f.filename),
                     None)
        where = f" ({Path(frame.filename).name}:{frame.lineno}, in {frame.name})" if frame else ""
        raise ConfigError(
            f"{type(model).__name__} works on the attention mask itself{where}: {err}; context parallelism "
            f"hands its attention a whole-sequence mask, so it cannot split this model; use cp=1"
        ) from None
    except Exception:  # not cp's question: the meta device does not run every model (see the docstring)
        return
