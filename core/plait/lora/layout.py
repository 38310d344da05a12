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
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from dataclasses import dataclass

from torch import nn

from plait.config import ConfigError
from plait.lora.config import check_supported, scaling
from plait.tp.layout import plan_tensor_parallel
from plait.tp.sharding import ModuleShard, ShardSpec, linear_shape
from plait.tp.styles import Column, Row

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig


LORA_A, LORA_B = "lora_A", "lora_B"


@dataclass(frozen=True)
class LoraModule:
    """One adapted module on one tp rank: its kind, the specs of A and B, and who sums their gradients
    (a number of adjacent tp ranks; 1: nobody)."""

    name: str
    kind: str  # "column" | "row" | "whole"
    a: ShardSpec
    b: ShardSpec
    a_grad_sum: int = 1
    b_grad_sum: int = 1

    @property
    def a_name(self) -> str:
        return f"{self.name}.{LORA_A}.weight"

    @property
    def b_name(self) -> str:
        return f"{self.name}.{LORA_B}.weight"


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA config (target modules resolved to a list of names peft matches) and, per tp rank, every
    adapted module."""

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


def default_targets(model: nn.Module, tp_plan) -> list[str]:
    """The projections the adapter's TP plan splits as column or row (attention and MLP), as the last
    component of their names (peft's ``target_modules`` style: ``["q_proj", "k_proj", ...]``)."""
    if tp_plan is None:
        raise ConfigError("the model's adapter has no TP plan to take LoRA target modules from; "
                          "name them with --lora_target_modules (e.g. q_proj,v_proj)")
    shards = plan_tensor_parallel(model, tp_plan, 1, 0, parallel_embeddings=False)
    return sorted({name.rpartition(".")[2] for name, s in shards.items() if isinstance(s.style, (Column, Row))})


def plan_lora(
    model: nn.Module, config: LoraConfig, shards_by_rank: tuple[dict[str, ModuleShard], ...], tp_plan,
    sequence_parallel: bool,
) -> LoraPlan:
    """Place LoRA on every module of ``model`` that ``config.target_modules`` matches (peft's matching).

    Raises ConfigError naming the module for a target that is not a linear layer, or that TP splits in a way
    LoRA cannot follow (vocab-parallel head, experts), and when no module matches.
    """
    check_supported(config)
    if config.target_modules is None:
        config.target_modules = default_targets(model, tp_plan)
    tp = len(shards_by_rank)
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = [name for name, _ in model.named_modules() if name and check_target_module_exists(config, name)]
    if not targets:
        raise ConfigError(f"--lora_target_modules {config.target_modules} match no module of "
                          f"{type(model).__name__}; name projections such as q_proj,v_proj")
    modules_by_rank = []
    for rank in range(tp):
        placed = {}
        for name in targets:
            placed[name] = _place(name, model.get_submodule(name), shards_by_rank[rank].get(name), config.r,
                                  tp, sequence_parallel)
        modules_by_rank.append(placed)
    return LoraPlan(config, scaling(config), tuple(modules_by_rank))


def _place(name: str, module: nn.Module, shard: ModuleShard | None, r: int, tp: int, sp: bool) -> LoraModule:
    try:
        fan_in, fan_out, _ = linear_shape(module)
    except ConfigError:
        raise ConfigError(f"LoRA target {name} is a {type(module).__name__}; plait adapts Linear and Conv1D "
                          f"layers only: narrow --lora_target_modules") from None
    a_full, b_full = ShardSpec((r, fan_in)), ShardSpec((fan_out, r))
    if shard is None:
        return LoraModule(name, "whole", a_full, b_full)
    if type(shard.style) is Row:
        a = ShardSpec((r, fan_in), 1, shard.weight.ranges)
        return LoraModule(name, "row", a, b_full, b_grad_sum=tp if sp else 1)
    if isinstance(shard.style, Column) and not shard.weight.pad:
        b = ShardSpec((fan_out, r), 0, shard.weight.ranges)
        return LoraModule(name, "column", a_full, b, a_grad_sum=tp, b_grad_sum=shard.grad_sum_block)
    raise ConfigError(f"LoRA target {name} is split as {shard.style.label!r} by the TP plan; LoRA follows column- "
                      f"and row-parallel projections only: leave it out of --lora_target_modules")
