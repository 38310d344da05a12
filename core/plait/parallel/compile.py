"""``torch.compile`` of the leaf modules (decoder layers), one compiled region per layer.

Compiling the whole model would break its graph at every tensor-parallel collective and pipeline stage
boundary; compiling each decoder layer (as torchtitan does per transformer block) keeps the compiled regions
inside what one rank computes, and identical layers share one compiled graph. ``nn.Module.compile`` compiles
in place, so parameter names, shard specs, checkpoints and the optimizer see the same modules as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from plait.base.patterns import leaf_module_names


def compile_leaf_modules(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Compile every module of ``model`` whose name matches one of ``patterns``; return their names."""
    names = leaf_module_names(model, patterns, "--torch_compile")
    for name in names:
        model.get_submodule(name).compile()
    return names
