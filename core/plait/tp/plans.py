"""What an adapter declares for tensor and sequence parallelism: which modules split how (``TPPlan``, a tuple of
the styles in ``plait.tp.styles``) and the sequence-parallel region (``SPPlan``).

They live in ``tp/``, beside the styles, so that the tensor-parallel mechanisms read them without importing the
plugin layer above (``plait.plugin.declarations`` holds the rest of what an adapter declares); adapters import
them from ``plait`` (``plait.TPPlan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.tp.styles import TPRule


@dataclass(frozen=True)
class TPPlan:
    """Returned by ``plait_tp_plan``: every module not matched stays replicated."""

    rules: tuple[TPRule, ...]


@dataclass(frozen=True)
class SPPlan:
    """Returned by ``plait_sp_plan``: the sequence-parallel region.

    ``begin``: the module whose first input is split along the sequence (the first decoder layer, so that
    transformers has already built position ids, rotary tables and the causal mask from the full sequence).
    ``end``: the module whose output is gathered back (the final norm). ``norms``: patterns of every module
    with replicated parameters that runs on sequence shards inside the region (layer norms); their
    gradients are summed over tp so they stay equal on every rank. ``side_inputs``: names of the decoder layers'
    forward arguments besides the hidden states that hold one value per token as they do ([batch, sequence, ...]:
    Gemma 4's per-layer inputs, Zamba's embeddings concatenated into its shared attention), which the model computes
    before its layers on the whole sequence; every layer of the region gets this rank's sequence shard of them.
    """

    begin: str
    end: str
    norms: tuple[str, ...]
    side_inputs: tuple[str, ...] = ()
