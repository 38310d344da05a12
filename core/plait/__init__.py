"""plait: tensor, sequence and pipeline parallelism and ZeRO-1 for Hugging Face transformers models."""

from plait.config import ConfigError, ParallelConfig
from plait.declarations import AdapterInfo, Capabilities, PipelinePlan, SPPlan, TPPlan
from plait.layout_plan import LayoutPlan, plan_layout
from plait.markers import hookimpl
from plait.mesh import Mesh
from plait.parallelize import ParallelModel, parallelize
from plait.registry import AdapterError, Registry, default_registry, register
from plait.tp.styles import Attention, Column, Row, VocabEmbedding, VocabHead

__version__ = "0.1.0"

__all__ = [
    "AdapterError", "AdapterInfo", "Attention", "Capabilities", "Column", "ConfigError", "Mesh",
    "LayoutPlan", "ParallelConfig", "ParallelModel", "PipelinePlan", "Registry", "Row", "SPPlan", "TPPlan", "VocabEmbedding",
    "VocabHead", "default_registry", "hookimpl", "parallelize", "plan_layout", "register",
]
