"""Tensor-parallel styles: one class per way of splitting a module, imported by adapters from here.

A rule names a module pattern. ``shards`` decides, for one tp rank and on a meta model, what each matching
module keeps (pure; every divisibility problem is found here, before any process group); ``build`` makes
the parallel layer that replaces the module from its local weights. Adding a style is one class in the module of
its kind and, if it needs one, one layer in ``tp/layers.py``:

``base`` (``TPRule``, ``BuildContext``), ``linear`` (single modules: column, row, vocab, norm and parameter
rules), ``attention`` (attention blocks split by heads, and ``WholeSequence`` for a mixer kept whole),
``experts`` (MoE experts and router). ``from plait.tp.styles import Column, ...`` is the adapters' import path.
"""

from plait.tp.styles.attention import (
    Attention, FullWidthNormAttention, HeadInterleavedAttention, LatentAttention, LocalConfigAttention,
    PairedHeadsAttention, WholeSequence,
)
from plait.tp.styles.base import BuildContext, TPRule
from plait.tp.styles.experts import ExpertMajorExperts, MoEExperts, MoERouter, WholeExperts
from plait.tp.styles.linear import (
    Column, FusedColumn, FusedQKV, HeadParams, ReplicatedGradSum, Row, ScaledVocabEmbedding, SplitNorm, VocabEmbedding,
    VocabHead,
)

__all__ = [
    "Attention", "BuildContext", "Column", "ExpertMajorExperts", "FullWidthNormAttention", "FusedColumn", "FusedQKV",
    "HeadInterleavedAttention", "HeadParams", "LatentAttention", "LocalConfigAttention", "MoEExperts", "MoERouter",
    "PairedHeadsAttention", "ReplicatedGradSum", "Row", "ScaledVocabEmbedding", "SplitNorm", "TPRule", "VocabEmbedding",
    "VocabHead", "WholeExperts", "WholeSequence",
]
