"""plait: tensor, sequence and pipeline parallelism and ZeRO-1 for Hugging Face transformers models."""

import logging

# transformers imports torchao whenever it is installed (plait's float8 extra, the test extra). torchao then logs a
# warning for each optional kernel library its build cannot load, and torch one for each enum torchao registers:
# lines in every command's output that no plait user can act on. Those two loggers are quieted to errors, unless
# the user set their level.
for _name in ("torchao", "torch.utils._pytree"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.ERROR)

from plait.base.config import ConfigError, ParallelConfig
from plait.base.markers import hookimpl
from plait.base.mesh import Mesh
from plait.layout_plan import LayoutPlan, plan_layout
from plait.parallelize import ParallelModel, parallelize
from plait.plugin.declarations import AdapterInfo, Capabilities, PipelinePlan
from plait.plugin.registry import AdapterError, Registry, default_registry, register
from plait.tp.loss import num_items_in_batch
from plait.tp.plans import SPPlan, TPPlan
from plait.tp.styles import Attention, Column, Row, VocabEmbedding, VocabHead


__version__ = "0.1.0"

__all__ = [
    "AdapterError", "AdapterInfo", "Attention", "Capabilities", "Column", "ConfigError", "Mesh",
    "LayoutPlan", "ParallelConfig", "ParallelModel", "PipelinePlan", "Registry", "Row", "SPPlan", "TPPlan", "VocabEmbedding",
    "VocabHead", "default_registry", "hookimpl", "num_items_in_batch", "parallelize", "plan_layout", "register",
]
