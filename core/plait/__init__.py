"""plait: tensor, sequence and pipeline parallelism and ZeRO-1 for Hugging Face transformers models."""

import importlib
import logging

# transformers imports torchao whenever it is installed (plait's float8 extra, the test extra). torchao then logs a
# warning for each optional kernel library its build cannot load, and torch one for each enum torchao registers:
# lines in every command's output that no plait user can act on. Those two loggers are quieted to errors, unless
# the user set their level.
for _name in ("torchao", "torch.utils._pytree"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.ERROR)

# The public names, each from the module that defines it. They are imported when first used (PEP 562), not with
# the package: every `plait` command, and every module of the package, imports `plait` first, and these modules
# bring in torch.distributed, transformers and the generic adapter's derivation (seconds), which `plait --help`,
# `plait adapters` and a worker importing only plait.testing do not need.
_WHERE = {
    "ConfigError": "plait.config", "ParallelConfig": "plait.config",
    "AdapterInfo": "plait.declarations", "Capabilities": "plait.declarations", "PipelinePlan": "plait.declarations",
    "SPPlan": "plait.declarations", "TPPlan": "plait.declarations",
    "LayoutPlan": "plait.layout_plan", "plan_layout": "plait.layout_plan",
    "hookimpl": "plait.markers",
    "Mesh": "plait.mesh",
    "ParallelModel": "plait.parallelize", "parallelize": "plait.parallelize",
    "AdapterError": "plait.registry", "Registry": "plait.registry", "default_registry": "plait.registry",
    "register": "plait.registry",
    "Attention": "plait.tp.styles", "Column": "plait.tp.styles", "Row": "plait.tp.styles",
    "VocabEmbedding": "plait.tp.styles", "VocabHead": "plait.tp.styles",
}


def __getattr__(name: str) -> object:
    """``plait.NAME`` for a public name: imported from its module on first use, then kept here."""
    if name not in _WHERE:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__version__ = "0.1.0"

__all__ = [
    "AdapterError", "AdapterInfo", "Attention", "Capabilities", "Column", "ConfigError", "Mesh",
    "LayoutPlan", "ParallelConfig", "ParallelModel", "PipelinePlan", "Registry", "Row", "SPPlan", "TPPlan", "VocabEmbedding",
    "VocabHead", "default_registry", "hookimpl", "parallelize", "plan_layout", "register",
]
