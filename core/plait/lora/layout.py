"""LoRA's part of the layout plan: where every LoRA adapter goes and what each tp rank holds of it; pure, on a
meta model, before any group.

LoRA follows its base layer (docs/lora.md). In peft's layout, A is [r, in] and B is [out, r]:

* column-parallel base (output features split): A whole on every rank, applied to the base's entered input
  (replicated, or gathered from sequence shards); its gradient is a partial sum over tp, summed like other
  replicated parameters inside the region. B keeps the base's output ranges (whole heads of q, k and v for a
  fused qkv), and is summed over the block of ranks sharing a kv head, like its base.
* row-parallel base (input features split): A keeps the base's input ranges; its rank-r result is
  all-reduced, or reduce-scattered to sequence shards under SP, where the base output is. B whole: its
  gradient sees only a sequence shard under SP, so it is summed over tp there.
* a base kept whole (tp=1, or a module the TP plan leaves replicated): both whole, nothing summed.

A parameter stacked over experts (peft's ``target_parameters``; the update in ``lora/experts.py``) has A
[r * E, in] and B [out, r * E]. tp splits routed experts on their intermediate dimension: gate_up / up on its
output (column: B keeps those ranges, A whole, A's gradient summed over tp), down on its input (row: A keeps
them, B whole). The update is of the weight, so each rank's B_e @ A_e slice needs no collective, but then B's
gradient for a row split comes from the rank's own input features: it is summed over tp with or without SP.
Under ep a rank holds its experts' rows of A and columns of B (``ShardSpec.expert_axis``; ``EPPlan.localize``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

from plait.base.config import ConfigError
from plait.base.words import setting
from plait.ep.layout import routed_experts
from plait.lora.config import check_supported, scaling
from plait.tp.layout import plan_tensor_parallel
from plait.tp.sharding import ExpertAxis, ModuleShard, ShardSpec, linear_shape
from plait.tp.styles import Column, Row

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig


LORA_A, LORA_B = "lora_A", "lora_B"
WRAPPER = "base_layer"  # peft's name for a module wrapped to adapt one of its parameters


@dataclass(frozen=True)
class LoraModule:
    """One adapted module (or ``parameter`` of an experts module) on one tp rank: where its factors go (``name``),
    its kind, the specs of A and B, and who sums their gradients (a number of adjacent tp ranks; 1: nobody)."""

    name: str
    kind: str  # "column" | "row" | "whole"
    a: ShardSpec
    b: ShardSpec
    a_grad_sum: int = 1
    b_grad_sum: int = 1
    parameter: str | None = None  # peft's target_parameters: the adapted parameter of ``module``
    b_shared: tuple[int, ...] = ()  # of B's ranges, those b_grad_sum sums (a fused qkv's kv rows); () = all

    @property
    def module(self) -> str:
        """The adapted module: ``name`` itself, or without peft's wrappers around it for a parameter."""
        name = self.name
        while self.parameter is not None and name.endswith(f".{WRAPPER}"):
            name = name.removesuffix(f".{WRAPPER}")
        return name

    @property
    def a_name(self) -> str:
        return f"{self.name}.{LORA_A}.weight"

    @property
    def b_name(self) -> str:
        return f"{self.name}.{LORA_B}.weight"


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA config (target modules resolved to a list of names peft matches) and, per tp rank, every
    adapted module and parameter, by where its factors go."""

    config: LoraConfig
    scale: float
    modules_by_rank: tuple[dict[str, LoraModule], ...]

    def specs(self, tp_rank: int) -> dict[str, ShardSpec]:
        """Shard spec of every LoRA parameter on tp rank ``tp_rank``, by parameter name."""
        specs = {}
        for module in self.modules_by_rank[tp_rank].values():
            specs[module.a_name], specs[module.b_name] = module.a, module.b
        return specs

    def param_names(self) -> set[str]:
        return set(self.specs(0))


def default_targets(model: nn.Module, tp_plan) -> list[str] | str:
    """The projections the adapter's TP plan splits as column or row (attention and MLP), as the last
    component of their names (peft's ``target_modules`` style: ``["q_proj", "k_proj", ...]``); where other modules
    end in the same names (an image-text model's vision tower: its own q_proj, ...), the planned ones by their whole
    names, as peft's regular-expression form (the language model only)."""
    if tp_plan is None:
        example = setting("target_modules", ["q_proj", "v_proj"])
        raise ConfigError(f"the model's adapter has no TP plan to take LoRA target modules from; name them, e.g. "
                          f"{example}")
    shards = plan_tensor_parallel(model, tp_plan, 1, 0, parallel_embeddings=False)
    planned = {name for name, s in shards.items() if isinstance(s.style, (Column, Row))}
    suffixes = sorted({name.rpartition(".")[2] for name in planned})
    if {name for name, _ in model.named_modules() if name.rpartition(".")[2] in suffixes} <= planned:
        return suffixes
    return "|".join(re.escape(name) for name in sorted(planned))


def parameter_targets(model: nn.Module, config: LoraConfig) -> dict[str, tuple[str, str]]:
    """The parameters ``config.target_parameters`` matches, by where peft puts their factors: {name: (module,
    parameter)}. peft matches ``<module>.<parameter>`` equal to a target or ending in ``.<target>``, and wraps
    the matched parameters of a module in the module's order, each wrapper around the last: the first ends
    innermost, under one ``base_layer`` per later one (``mlp.experts.base_layer`` for gate_up_proj,
    ``mlp.experts`` for down_proj)."""
    targets = sorted(set(config.target_parameters or ()))
    found = {}
    for module_name, module in model.named_modules():
        keys = {leaf: f"{module_name}.{leaf}" for leaf, _ in module.named_parameters(recurse=False)}
        leaves = [leaf for leaf, key in keys.items() if any(key == t or key.endswith(f".{t}") for t in targets)]
        for i, leaf in enumerate(leaves):
            found[module_name + f".{WRAPPER}" * (len(leaves) - 1 - i)] = (module_name, leaf)
    return found


def plan_lora(
    model: nn.Module, config: LoraConfig, shards_by_rank: tuple[dict[str, ModuleShard], ...], tp_plan,
    sequence_parallel: bool,
) -> LoraPlan:
    """Place LoRA on every module of ``model`` that ``config.target_modules`` matches (peft's matching; None:
    the adapter's projections, ``[]``: none) and on every parameter ``config.target_parameters`` matches.

    Raises ConfigError naming the module for a target that is not a linear layer, or that TP splits in a way
    LoRA cannot follow (vocab-parallel head), for a target parameter that is not a routed expert weight, and
    when a list of targets matches nothing.
    """
    check_supported(config)
    if config.target_modules is None:
        config.target_modules = default_targets(model, tp_plan)
    tp = len(shards_by_rank)
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = [name for name, _ in model.named_modules() if name and check_target_module_exists(config, name)]
    if config.target_modules and not targets:
        raise ConfigError(f"{setting('target_modules', config.target_modules)} match no module of "
                          f"{type(model).__name__}; name projections such as q_proj,v_proj")
    params = parameter_targets(model, config)
    if config.target_parameters and not params:
        raise ConfigError(f"{setting('target_parameters', config.target_parameters)} match no parameter of "
                          f"{type(model).__name__}; name expert weights such as mlp.experts.gate_up_proj")
    if not targets and not params:
        raise ConfigError(f"LoRA has nothing to adapt: name {setting('target_modules')} or "
                          f"{setting('target_parameters')}")
    experts = routed_experts(model)
    modules_by_rank = []
    for rank in range(tp):
        placed = {}
        for name in targets:
            placed[name] = _place(name, model.get_submodule(name), shards_by_rank[rank].get(name), config.r,
                                  tp, sequence_parallel)
        for name, (module, leaf) in params.items():
            if module not in experts:
                raise ConfigError(f"LoRA target parameter {module}.{leaf} is not in routed experts (a module built "
                                  f"with transformers' use_experts_implementation); plait adapts those only: adapt "
                                  f"a linear layer through {setting('target_modules')}")
            placed[name] = _place_parameter(name, leaf, experts[module], shards_by_rank[rank].get(module), config.r, tp)
        modules_by_rank.append(placed)
    return LoraPlan(config, scaling(config), tuple(modules_by_rank))


def _place_parameter(name: str, leaf: str, module: nn.Module, shard: ModuleShard | None, r: int, tp: int) -> LoraModule:
    """LoRA on parameter ``leaf`` of an experts module, following tp's split of it (module docstring)."""
    param = module.get_parameter(leaf)
    if param.dim() != 3:
        raise ConfigError(f"LoRA target parameter {leaf} of {type(module).__name__} has shape {list(param.shape)}; "
                          f"plait adapts expert weights stacked over experts (3-D) only: leave it out of "
                          f"{setting('target_parameters')}")
    experts = param.shape[0]
    out_dim, in_dim = (2, 1) if getattr(module, "is_transposed", False) else (1, 2)
    a = ShardSpec((r * experts, param.shape[in_dim]), expert_axis=ExpertAxis(0, 1, r))
    b = ShardSpec((param.shape[out_dim], r * experts), expert_axis=ExpertAxis(1, r, 1))
    split = shard.spec(leaf) if shard is not None else None
    if split is None or split.dim is None:
        return LoraModule(name, "whole", a, b, parameter=leaf)
    if split.dim == out_dim and not split.pad:
        return LoraModule(name, "column", a, replace(b, dim=0, ranges=split.ranges), a_grad_sum=tp, parameter=leaf)
    if split.dim == in_dim and not split.pad:
        return LoraModule(name, "row", replace(a, dim=1, ranges=split.ranges), b, b_grad_sum=tp, parameter=leaf)
    raise ConfigError(f"LoRA target parameter {leaf} of {type(module).__name__} is split on dim {split.dim} by "
                      f"the TP plan; LoRA follows a split of its input or output features only: leave it out of "
                      f"{setting('target_parameters')}")


def _place(name: str, module: nn.Module, shard: ModuleShard | None, r: int, tp: int, sp: bool) -> LoraModule:
    try:
        fan_in, fan_out, _ = linear_shape(module)
    except ConfigError:
        raise ConfigError(f"LoRA target {name} is a {type(module).__name__}; plait adapts Linear and Conv1D "
                          f"layers only: narrow {setting('target_modules')}") from None
    a_full, b_full = ShardSpec((r, fan_in)), ShardSpec((fan_out, r))
    if shard is None:
        return LoraModule(name, "whole", a_full, b_full)
    if type(shard.style) is Row:
        a = ShardSpec((r, fan_in), 1, shard.weight.ranges)
        return LoraModule(name, "row", a, b_full, b_grad_sum=tp if sp else 1)
    if isinstance(shard.style, Column) and not shard.weight.pad:
        b = ShardSpec((fan_out, r), 0, shard.weight.ranges)
        return LoraModule(name, "column", a_full, b, a_grad_sum=tp, b_grad_sum=shard.grad_sum_block,
                          b_shared=shard.shared_ranges)
    raise ConfigError(f"LoRA target {name} is split as {shard.style.label!r} by the TP plan; LoRA follows column- "
                      f"and row-parallel projections only: leave it out of {setting('target_modules')}")
