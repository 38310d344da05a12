"""One forward of a copy of a meta model with context parallelism installed: refusals found before launch.

Most of what cp cannot do is visible in the model's structure (plait.cp.layout). Model code that uses the
attention mask itself before handing it to the attention function (Doge's dynamic mask adds learned scores
to it), or builds a mask where plait's wrapped builders do not see it, is visible only by running it: a forward
of a short sequence on the meta device, on a copy of the model (a meta copy costs no memory), with the cp
implementation installed on a group of one rank.

What can go wrong there, each by name:

* ``MaskRead``: the model read the cp mask object as a tensor: refused, naming the file and line;
* a mask built from the local slice (a builder of ``transformers.masking_utils`` plait did not wrap: it raises
  inside masking_utils, reading the local position ids, or in plait's mask interface, whose lengths do not match
  the whole sequence): refused, naming the builder and the model code that called it;
* an attention call handed a mask plait did not build (masks built without masking_utils): refused, naming the
  attention module;
* a value the meta device does not hold (``.item()``, ``.tolist()``, ``nonzero``) read by model code outside the
  mask builders: MoE routing that counts its tokens (JetMoE's gating). Routed experts (transformers'
  ``use_experts_implementation``, or any module with its contract ``forward(hidden_states, top_k_index,
  top_k_weights)``: DBRX's, LongCat-Flash's) are replaced in the copy by
  a stand-in of the same output shape, since they are token by token and never see a mask; where other routing
  code reads values, the dry run ends there and the rest of the forward is the conformance kit's question
  (``plait check-adapter``), as for any model.

Anything else the forward raises is not caught: it is a bug of plait's or of the model's meta forward, shown as
is.
"""

from __future__ import annotations

import copy
import inspect
import traceback
import weakref
from pathlib import Path
from types import TracebackType

import torch
from torch import nn

from plait.base.config import ConfigError
from plait.cp.attention import install_context_parallel
from plait.cp.context import ContextParallel
from plait.cp.layout import CPPlan
from plait.cp.masks import MaskRead
from plait.ep.layout import is_routed_experts

SEQ = 8
ROUTING = ("hidden_states", "top_k_index", "top_k_weights")  # transformers' routed-experts forward
# What torch raises where code reads a value a meta tensor does not hold: .item(), .tolist(), nonzero's length.
META_VALUES = ("Tensor.item() cannot be called on meta tensors", "Cannot copy out of meta tensor",
               "register_meta function for torch.nonzero()")
MASK_MISMATCH = "was built outside a context-parallel forward of whole sequences"  # plait.cp.masks
FOREIGN_MASK = "mask, not one plait built over the whole sequence"  # plait.cp.attention
# check_on_meta's verdict per model: (its modules and config when checked, the refusal or None)
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_on_meta(model: nn.Module) -> None:
    """Raise ConfigError when ``model`` (on the meta device; others are not run) reads the cp mask itself, builds
    a mask plait cannot hand the whole sequence, or hands its attention a mask plait did not build.

    The forward runs on a group of one whatever the layout, so its verdict is the model's: kept per model (while
    its modules and config stay as they were), a search planning many cp layouts of one model runs it once."""
    if not all(p.is_meta for p in model.parameters()):
        return
    shape = (tuple((name, type(m)) for name, m in model.named_modules()), model.config.to_json_string())
    known = _VERDICTS.get(model)
    if known is not None and known[0] == shape:
        if known[1] is not None:
            raise ConfigError(known[1])
        return
    try:
        _run_on_meta(model)
    except ConfigError as err:
        _VERDICTS[model] = (shape, str(err))
        raise
    _VERDICTS[model] = (shape, None)


def _run_on_meta(model: nn.Module) -> None:
    """``check_on_meta``'s forward of a copy of ``model`` with cp installed on a group of one."""
    shadow = copy.deepcopy(model)
    names = {id(m): name or type(shadow).__name__ for name, m in shadow.named_modules()}
    for module in shadow.modules():
        if is_routed_experts(module) or tuple(inspect.signature(type(module).forward).parameters)[1:4] == ROUTING:
            module.forward = _shape_only  # token by token and routed by values the meta device does not hold
    cp = ContextParallel(None, 0, CPPlan(1, "all-to-all", None, None), install_context_parallel(shadow))
    ids = torch.zeros((1, SEQ), dtype=torch.long, device="meta")
    try:
        with torch.no_grad(), cp.forward(1, SEQ, None, None, ids.device) as local:
            shadow(input_ids=ids, use_cache=False, **local)
    except MaskRead as err:
        frame = _last_frame(err.__traceback__, lambda f: "cp/masks.py" not in f.filename)
        raise ConfigError(
            f"{type(model).__name__} works on the attention mask itself{_at(frame)}: {err}; context parallelism "
            f"hands its attention a whole-sequence mask, so it cannot split this model; use cp=1"
        ) from None
    except (RuntimeError, NotImplementedError) as err:
        text = " ".join(str(err).split())
        builder = _last_frame(err.__traceback__, lambda f: Path(f.filename).name == "masking_utils.py")
        if MASK_MISMATCH in text or (builder is not None and any(v in text for v in META_VALUES)):
            caller = _last_frame(err.__traceback__, lambda f: "/transformers/models/" in f.filename)
            raise ConfigError(
                f"{type(model).__name__} builds an attention mask from this rank's slice of the sequence"
                f"{_at(caller)}, through {_builder(err.__traceback__)} of transformers.masking_utils, which plait "
                f"does not hand the whole sequence: context parallelism cannot split this model; use cp=1"
            ) from None
        if FOREIGN_MASK in text:
            where = _module(err.__traceback__, names)
            raise ConfigError(f"{where}: {text}; use cp=1") from None
        if not any(v in text for v in META_VALUES):
            raise
        # model code read a value (MoE routing counting its tokens): the meta device holds none, so the dry run
        # ends here; what follows is left to the conformance kit, as for any model


def _shape_only(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args, **kwargs) -> torch.Tensor:
    """Routed experts' output, shape only: what follows them on the meta device needs nothing else."""
    return torch.zeros_like(hidden_states)


def _last_frame(tb: TracebackType | None, keep) -> traceback.FrameSummary | None:
    return next((f for f in reversed(traceback.extract_tb(tb)) if keep(f)), None)


def _at(frame: traceback.FrameSummary | None) -> str:
    return f" ({Path(frame.filename).name}:{frame.lineno}, in {frame.name})" if frame else ""


def _builder(tb: TracebackType | None) -> str:
    """The outermost masking_utils function on the stack (the builder the model called)."""
    frames = [f for f in traceback.extract_tb(tb) if Path(f.filename).name == "masking_utils.py"]
    return f"{frames[0].name}" if frames else "a mask builder"


def _module(tb: TracebackType | None, names: dict[int, str]) -> str:
    """'name (Class)' of the innermost module of the model whose code is on the stack."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    found = None
    walk = tb.tb_frame if tb is not None else None
    while walk is not None and found is None:
        module = walk.f_locals.get("self")
        if isinstance(module, nn.Module) and id(module) in names:
            found = module
        walk = walk.f_back
    return f"{names[id(found)]} ({type(found).__name__})" if found is not None else "the model"
