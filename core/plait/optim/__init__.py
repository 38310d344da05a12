"""Optimizer side of plait: ZeRO-1, fp32 master weights, global-norm clipping, and the per-step driver."""

from plait.optim.clip import clip_grads_, global_grad_norm
from plait.optim.mixed_precision import MasterWeightOptimizer, accumulate_grads_in
from plait.optim.step import NonFiniteStep, OptimizerStep, UncommittedStep, build_optimizer
from plait.optim.zero import Zero1Optimizer

__all__ = [
    "MasterWeightOptimizer", "NonFiniteStep", "OptimizerStep", "UncommittedStep", "Zero1Optimizer",
    "accumulate_grads_in", "build_optimizer", "clip_grads_", "global_grad_norm",
]
