"""The whole sequence's attention mask under context parallelism, exactly as transformers builds it.

A model builds its masks with ``transformers.masking_utils`` (``create_causal_mask``,
``create_sliding_window_causal_mask``, ...): those turn the config (sliding windows, chunks), the position ids
(packed documents: transformers finds them where positions restart, and measures windows within a document)
and the padding mask into one index function ``mask_function(batch, head, q, kv) -> bool``, then hand it to
the mask interface of the attention implementation to materialise. Under cp two things change:

* the builders a modeling module imported are wrapped so that, while a cp forward runs, they see the whole
  sequence's position ids, padding mask and length instead of the local slices the model was called with;
  the index function then speaks whole-sequence coordinates. Outside a cp forward the wrappers pass through;
* the model's attention implementation is plait's (``plait.cp.attention``), whose mask interface returns a
  ``SequenceMask`` (the index function and its arguments) instead of a tensor, so each strategy evaluates
  exactly the block of the mask it needs: all of it for all-to-all, one (query chunk, key chunk) pair at a
  time for the ring, through transformers' own mask interface of the implementation the model chose.

Whatever mask transformers computes for an architecture is therefore the mask cp applies; nothing here
knows what a sliding window or a document is.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from plait.cp.sequence import SequenceContext, current

_WRAPPED = "__plait_cp_wrapped__"


EMPTY, FULL = "empty", "full"  # a tile the mask excludes entirely, or keeps entirely


class MaskRead(AttributeError):
    """Model code used a cp ``SequenceMask`` as a tensor: it works on the mask itself (e.g. Doge's dynamic mask),
    which context parallelism cannot hand it whole."""


@dataclass
class SequenceMask:
    """A mask over the whole sequence, not yet materialised: what a mask builder handed the mask interface.

    Only plait's attention function reads it; model code that treats it as a tensor (``.dtype``, indexing)
    gets ``MaskRead``, naming what it read."""

    mask_function: Callable
    batch_size: int
    seq: int
    padding: torch.Tensor | None  # [batch, S] bool, or None
    options: dict[str, Any]  # the rest of the mask interface's arguments (dtype, config, use_vmap, ...)
    context: SequenceContext
    # Shared by every layer of the forward and its backward: the whole mask per implementation (all-to-all),
    # and per ring tile either EMPTY, FULL or its boolean block (so that only the tiles a mask cuts through,
    # e.g. the causal diagonal, hold memory: about b * S/C * TILE bytes per rank, not b * S^2 / C).
    whole: dict[str, Any] = field(default_factory=dict, repr=False)
    tiles: dict[tuple, Any] = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> Any:  # only called for attributes a SequenceMask does not have
        raise MaskRead(f"attention_mask.{name} was read off context parallelism's whole-sequence mask object")

    def __getitem__(self, key: Any) -> Any:
        raise MaskRead("attention_mask[...] was indexed where context parallelism hands a whole-sequence mask object")

    def materialise(self, implementation: str) -> Any:
        """The whole mask as transformers builds it for ``implementation`` (None where sdpa may skip it)."""
        if implementation not in self.whole:
            interface = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
            self.whole[implementation] = interface(
                batch_size=self.batch_size, q_length=self.seq, kv_length=self.seq, q_offset=0, kv_offset=0,
                mask_function=self.mask_function, attention_mask=self.padding, **self.options,
            )
        return self.whole[implementation]

    def tile(self, q: tuple[int, int], kv: tuple[int, int]) -> Any:
        """Query positions [q0, q1) against key positions [kv0, kv1) of the whole sequence: EMPTY (nothing
        attends), FULL (everything does) or the boolean [batch, 1, rows, columns] block (True: attend)."""
        if (q, kv) not in self.tiles:
            block = self.block(q, kv)
            self.tiles[q, kv] = EMPTY if not bool(block.any()) else FULL if bool(block.all()) else block
        return self.tiles[q, kv]

    def block(self, q: tuple[int, int], kv: tuple[int, int]) -> torch.Tensor:
        """The boolean [batch, 1, q rows, kv columns] block of the mask for [q0, q1) x [kv0, kv1)."""
        return sdpa_mask(
            batch_size=self.batch_size, q_length=q[1] - q[0], kv_length=kv[1] - kv[0], q_offset=q[0],
            kv_offset=kv[0], mask_function=self.mask_function, attention_mask=self.padding,
            allow_is_causal_skip=False, use_vmap=self.options.get("use_vmap", False),
            device=self.options.get("device", "cpu"),
        ).expand(self.batch_size, 1, q[1] - q[0], kv[1] - kv[0])


def sequence_mask_interface(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function, attention_mask: torch.Tensor | None = None,
    **options: Any,
) -> SequenceMask:
    """The mask interface of plait's cp attention: keeps the index function instead of materialising it."""
    context = current()
    if context is None or q_length != context.seq or kv_length != context.seq or q_offset or kv_offset:
        raise RuntimeError(
            f"a mask of {q_length} queries x {kv_length} keys was built outside a context-parallel forward of "
            f"whole sequences (a cache, or a mask builder plait did not wrap); cp supports training forwards only"
        )
    return SequenceMask(mask_function, batch_size, context.seq, attention_mask, options, context)


def _whole_sequence(builder: Callable) -> Callable:
    """``builder`` (a transformers mask builder) fed the whole sequence's inputs while a cp forward runs."""
    signature = inspect.signature(builder)

    @functools.wraps(builder)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        context = current()
        if context is None:
            return builder(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        embeds = "inputs_embeds" if "inputs_embeds" in arguments else "input_embeds"
        if embeds in arguments and arguments[embeds] is not None:
            local = arguments[embeds]  # only its batch, length, dtype and device are read: a free stand-in
            arguments[embeds] = local[:, :1].expand(local.shape[0], context.seq, *local.shape[2:])
        if isinstance(arguments.get("attention_mask"), torch.Tensor) and arguments["attention_mask"].dim() == 2:
            arguments["attention_mask"] = context.attention_mask
        if arguments.get("position_ids") is not None:  # (a meta dry run has no documents to find)
            arguments["position_ids"] = None if context.position_ids.is_meta else context.position_ids
        blocks = arguments.get("block_sequence_ids")
        if blocks is not None:  # [batch, S/C]: token groups attending within themselves (Gemma 4's images)
            if not blocks.is_meta and not bool((blocks == -1).all()):
                raise RuntimeError("block_sequence_ids with token groups (bidirectional blocks, such as images) are "
                                   "not supported under context parallelism")
            # all -1, every token causal (what a text-only forward passes): the same over the whole sequence (a meta
            # dry run cannot read them; a text forward is what cp trains)
            arguments["block_sequence_ids"] = blocks.new_full((blocks.shape[0], context.seq), -1)
        return builder(*bound.args, **bound.kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def mask_builders(model: nn.Module) -> dict[str, list[str]]:
    """The transformers mask builders each modeling module of ``model`` calls, by module name."""
    found: dict[str, list[str]] = {}
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        names = [key for key, value in vars(module).items() if _is_builder(value)] if module else []
        if names:
            found[name] = names
    return found


def _is_builder(value: Any) -> bool:
    """A mask builder of ``transformers.masking_utils``: ``create_*mask`` (``create_causal_mask``, ...) and
    ``create_masks_for_generate``, which Gemma 3/4's models call to build every layer type's mask at once (through
    the builders of masking_utils itself, which wrapping a modeling module's names does not reach)."""
    target = getattr(value, "__wrapped__", value) if getattr(value, _WRAPPED, False) else value
    name = getattr(target, "__name__", "")
    return (callable(target) and getattr(target, "__module__", None) == masking_utils.__name__
            and name.startswith("create_") and (name.endswith("mask") or name.startswith("create_masks_")))


def wrap_mask_builders(model: nn.Module) -> None:
    """Wrap, once per process, the mask builders the modeling modules of ``model`` imported (pass-through
    outside a cp forward, so other models in the process are unaffected)."""
    for module_name, names in mask_builders(model).items():
        module = sys.modules[module_name]
        for key in names:
            value = getattr(module, key)
            if not getattr(value, _WRAPPED, False):
                setattr(module, key, _whole_sequence(value))
