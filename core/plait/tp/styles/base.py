"""The base of every tensor-parallel style: ``TPRule`` and the ``BuildContext`` its ``build`` receives.

A rule names a module pattern. ``shards`` decides, for one tp rank and on a meta model, what each matching
module keeps (pure; every divisibility problem is found here, before any process group); ``build`` makes
the parallel layer that replaces the module from its local weights. The styles themselves (``linear``,
``attention``, ``experts``) are built on this module, which imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from plait.base.mesh import Mesh
from plait.tp.layers import TPRegionEntry
from plait.tp.sharding import ModuleShard


@dataclass(frozen=True)
class BuildContext:
    """What building a parallel layer needs from the running world."""

    mesh: Mesh
    entry: TPRegionEntry  # where activations enter the TP region (gathered from sequence shards under SP)
    sequence_parallel: bool


@dataclass(frozen=True)
class TPRule:
    """A module pattern (``model.layers.*.mlp.up_proj``) and how the modules it matches are split."""

    pattern: str
    label: ClassVar[str] = ""
    vocab_parallel: ClassVar[bool] = False  # kept replicated under disable_embedding_parallelization

    def shards(self, name: str, module: nn.Module, tp: int, rank: int) -> list[ModuleShard]:
        """Shard decisions of tp rank ``rank`` for module ``name`` (and, for a block, its children)."""
        raise NotImplementedError

    def build(self, shard: ModuleShard, module: nn.Module, ctx: BuildContext) -> nn.Module:
        """The parallel layer replacing ``module``, holding this rank's slices of its weights."""
        raise NotImplementedError(f"{type(self).__name__} shards child modules; it builds none itself")
