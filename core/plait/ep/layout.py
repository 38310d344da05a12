"""What expert parallelism does to a model, decided on the (meta) model before any process group exists.

The routed experts are the modules transformers builds with ``use_experts_implementation`` (67 MoE families in
transformers 5.24: mixtral, qwen2/3_moe, deepseek_v2/v3, gpt_oss, olmoe, granitemoe, phimoe, dots1, ...): every
parameter is stacked over experts on dim 0 (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], biases
[E, out]) and ``forward(hidden_states, top_k_index, top_k_weights)`` takes flattened tokens and the routing the
model's own router chose. That contract is all expert parallelism needs: ep rank r keeps experts
[r * E/ep, (r + 1) * E/ep) of every such module and receives the tokens routed to them (``plait.ep.dispatch``).
Experts that take another form (Llama4's expert-major ``forward(hidden_states)``, a model's own per-expert
ModuleList) are refused with the module's name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from plait.config import ConfigError, ParallelConfig
from plait.tp.sharding import ShardSpec


@dataclass(frozen=True)
class EPPlan:
    """The routed-experts modules (names in the unpruned model), their expert count and the ep size."""

    size: int
    modules: tuple[str, ...]
    num_experts: int
    capacity_factor: float | None = None

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    def expert_range(self, ep_rank: int) -> tuple[int, int]:
        """The experts ep rank ``ep_rank`` holds: [start, stop)."""
        return ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts

    def owns(self, param_name: str) -> bool:
        """Whether ``param_name`` (a model parameter's name) is stacked over experts."""
        return param_name.rpartition(".")[0] in self.modules

    def localize(self, specs: dict[str, ShardSpec], ep_rank: int) -> dict[str, ShardSpec]:
        """``specs`` (one tp rank's) with each expert parameter, and each tensor whose spec says where it stacks
        experts (``expert_axis``: LoRA factors on them), restricted to ep rank ``ep_rank``'s experts."""
        start, stop = self.expert_range(ep_rank)
        return {name: spec.with_experts(start, stop) if self.owns(name) or spec.expert_axis is not None else spec
                for name, spec in specs.items()}


def is_routed_experts(module: nn.Module) -> bool:
    """Whether ``module`` was built with transformers' ``use_experts_implementation`` (which sets
    ``_is_expert_parallel`` on it): the one test of "routed experts" for ep, the planner and the metrics."""
    return hasattr(module, "_is_expert_parallel")


def routed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` built with transformers' ``use_experts_implementation``, by name."""
    return {name: module for name, module in model.named_modules() if is_routed_experts(module)}


def plan_expert_parallel(model: nn.Module, config: ParallelConfig) -> EPPlan | None:
    """The EP plan for ``model`` at ``config`` (None at ep=1); ConfigError naming the module and the fix when the
    model's experts cannot be divided."""
    if config.ep == 1:
        return None
    model_type = getattr(model.config, "model_type", type(model).__name__)
    found = routed_experts(model)
    if not found:
        other = other_experts(model)
        if other:
            raise ConfigError(
                f"ep={config.ep}: {other} ({type(model.get_submodule(other)).__name__}) holds experts stacked on "
                f"dim 0, but its forward takes no routing (not transformers' use_experts_implementation), so its "
                f"tokens cannot be dispatched; use ep=1 for {model_type}"
            )
        raise ConfigError(
            f"ep={config.ep}, but {model_type} has no routed experts plait can divide (no module built with "
            f"transformers' use_experts_implementation); use ep=1"
        )
    counts = set()
    for name, module in found.items():
        params = dict(module.named_parameters(recurse=False))
        arguments = tuple(inspect.signature(type(module).forward).parameters)[1:4]
        shapes = {leaf: tuple(p.shape) for leaf, p in params.items()}
        experts = getattr(module, "num_experts", None)
        if len(arguments) < 3 or not params or any(s[0] != experts for s in shapes.values()):
            raise ConfigError(
                f"{name} ({type(module).__name__}): expert parallelism needs forward(hidden_states, top_k_index, "
                f"top_k_weights) and every parameter stacked over its num_experts={experts} experts (found "
                f"{shapes}); use ep=1 for {model_type}"
            )
        counts.add(experts)
    if len(counts) > 1:
        raise ConfigError(f"{model_type}: MoE layers with different expert counts {sorted(counts)}; use ep=1")
    experts = counts.pop()
    if experts % config.ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(
            f"{model_type} has {experts} experts per MoE layer, not divisible by ep={config.ep}; choose ep among "
            f"{divisors}"
        )
    return EPPlan(config.ep, tuple(found), experts, config.moe_capacity_factor)


def other_experts(model: nn.Module) -> str | None:
    """The first module whose own parameters are stacked over experts (3-D, in a module named like experts)
    without transformers' experts interface (Llama4's expert-major ``Llama4TextExperts``)."""
    for name, module in model.named_modules():
        if "expert" in name.rpartition(".")[2] and any(p.dim() == 3 for p in module.parameters(recurse=False)):
            return name
    return None
