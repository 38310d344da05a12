"""plait: tensor, sequence and pipeline parallelism and ZeRO-1 for Hugging Face transformers models."""

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

# transformers imports torchao whenever it is installed (plait's float8 extra, the test extra). torchao then logs a
# warning for each optional kernel library its build cannot load, and torch one for each enum torchao registers:
# lines in every command's output that no plait user can act on. Those two loggers are quieted to errors, unless
# the user set their level.
for _name in ("torchao", "torch.utils._pytree"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.ERROR)

# The public names and the module each lives in. They are imported on first use (PEP 562), not here: importing any
# plait module runs this file first, and the library's face pulls in transformers' modeling code (seconds), which
# the ``plait`` command's parser, its launcher process and ``plait --help`` never need.
_EXPORTS = {
    "ConfigError": "plait.base.config", "ParallelConfig": "plait.base.config", "hookimpl": "plait.base.markers",
    "Mesh": "plait.base.mesh", "LayoutPlan": "plait.layout_plan", "plan_layout": "plait.layout_plan",
    "ParallelModel": "plait.parallel_model", "parallelize": "plait.parallelize",
    "AdapterInfo": "plait.plugin.declarations", "Capabilities": "plait.plugin.declarations",
    "PipelinePlan": "plait.plugin.declarations", "AdapterError": "plait.plugin.registry",
    "Registry": "plait.plugin.registry", "default_registry": "plait.plugin.registry", "register": "plait.plugin.registry",
    "num_items_in_batch": "plait.tp.loss", "SPPlan": "plait.tp.plans", "TPPlan": "plait.tp.plans",
    "Attention": "plait.tp.styles", "Column": "plait.tp.styles", "Row": "plait.tp.styles",
    "VocabEmbedding": "plait.tp.styles", "VocabHead": "plait.tp.styles",
}

if TYPE_CHECKING:
    from plait.base.config import ConfigError, ParallelConfig
    from plait.base.markers import hookimpl
    from plait.base.mesh import Mesh
    from plait.layout_plan import LayoutPlan, plan_layout
    from plait.parallel_model import ParallelModel
    from plait.parallelize import parallelize
    from plait.plugin.declarations import AdapterInfo, Capabilities, PipelinePlan
    from plait.plugin.registry import AdapterError, Registry, default_registry, register
    from plait.tp.loss import num_items_in_batch
    from plait.tp.plans import SPPlan, TPPlan
    from plait.tp.styles import Attention, Column, Row, VocabEmbedding, VocabHead


class _Face(types.ModuleType):
    """The package's class: importing the submodule ``plait.parallelize`` binds it on the package, where the name
    ``parallelize`` is the function (as when this file imported it eagerly); this keeps it the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "parallelize" and isinstance(value, types.ModuleType):
            value = value.parallelize
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [  # the names of _EXPORTS, written out for tools that read __all__ without running this file
    "AdapterError", "AdapterInfo", "Attention", "Capabilities", "Column", "ConfigError", "LayoutPlan", "Mesh",
    "ParallelConfig", "ParallelModel", "PipelinePlan", "Registry", "Row", "SPPlan", "TPPlan", "VocabEmbedding",
    "VocabHead", "default_registry", "hookimpl", "num_items_in_batch", "parallelize", "plan_layout",
    "register",
]
