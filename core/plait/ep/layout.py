"""What expert parallelism does to a model, decided on the (meta) model before any process group exists.

The routed experts are the modules transformers builds with ``use_experts_implementation`` (67 MoE families in
transformers 5.24: mixtral, qwen2/3_moe, deepseek_v2/v3, gpt_oss, olmoe, granitemoe, phimoe, dots1, ...): every
parameter is stacked over experts on dim 0 (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], biases
[E, out]) and ``forward(hidden_states, top_k_index, top_k_weights)`` takes flattened tokens and the routing the
model's own router chose. That contract is all expert parallelism needs: ep rank r keeps experts
[r * E/ep, (r + 1) * E/ep) of every such module and receives the tokens routed to them (``plait.ep.dispatch``).
A model's own experts module with the same forward and a ``num_experts`` count serves the same way when every
parameter under it stacks its experts' rows on dim 0, expert-major, any number of rows each (DBRX's
``DbrxExperts``: ``mlp.w1`` / ``v1`` / ``w2`` [E * ffn, hidden], viewed per expert as [E, ffn, hidden]).
Experts that compute every expert on every token, expert-major (Llama 4's ``Llama4TextExperts``:
``forward(hidden_states [E * T, H])``, each parameter stacked on dim 0 over its ``num_experts``), are divided the
same way, each rank running its experts' blocks of every rank's tokens (``expert_major_experts``,
``plait.ep.dispatch.ExpertMajorParallel``). Experts that take another form (JetMoE's ``forward(inputs,
expert_size)`` over tokens already grouped by expert, a model's own per-expert ModuleList) are refused with the
module's name.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Collection
from dataclasses import dataclass

from torch import nn

from plait.base.config import ConfigError, ParallelConfig
from plait.tp.sharding import ExpertAxis, ShardSpec

ROUTING = ("hidden_states", "top_k_index", "top_k_weights")  # the forward of transformers' routed experts


@dataclass(frozen=True)
class EPPlan:
    """The routed-experts modules (names in the unpruned model), their expert count and the ep size."""

    size: int
    modules: tuple[str, ...]
    num_experts: int
    capacity_factor: float | None = None
    rows: tuple[tuple[str, int], ...] = ()  # (module, rows per expert on dim 0) where it is not 1 (DBRX's ffn)
    expert_major: bool = False  # the modules take every expert's copy of every token (``expert_major_experts``)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    def expert_range(self, ep_rank: int) -> tuple[int, int]:
        """The experts ep rank ``ep_rank`` holds: [start, stop)."""
        return ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts

    def module_of(self, param_name: str) -> str | None:
        """The experts module holding ``param_name`` (a model parameter's name) stacked over experts, or None."""
        return next((m for m in self.modules if param_name.startswith(f"{m}.")), None)

    def owns(self, param_name: str) -> bool:
        """Whether ``param_name`` (a model parameter's name) is stacked over experts."""
        return self.module_of(param_name) is not None

    def rows_per_expert(self, module: str) -> int:
        """Rows of dim 0 each expert takes in ``module``'s parameters (1: transformers' [E, ...])."""
        return dict(self.rows).get(module, 1)

    def localize(self, specs: dict[str, ShardSpec], ep_rank: int) -> dict[str, ShardSpec]:
        """``specs`` (one tp rank's) with each expert parameter, and each tensor whose spec says where it stacks
        experts (``expert_axis``: LoRA factors on them), restricted to ep rank ``ep_rank``'s experts."""
        start, stop = self.expert_range(ep_rank)
        found = {}
        for name, spec in specs.items():
            module = self.module_of(name)
            if module is not None and self.rows_per_expert(module) > 1 and spec.expert_axis is None:
                spec = dataclasses.replace(spec, expert_axis=ExpertAxis(block=self.rows_per_expert(module)))
            found[name] = spec.with_experts(start, stop) if module is not None or spec.expert_axis is not None \
                else spec
        return found


def is_routed_experts(module: nn.Module) -> bool:
    """Whether ``module`` was built with transformers' ``use_experts_implementation`` (which sets
    ``_is_expert_parallel`` on it): the one test of "routed experts" for ep, the planner and the metrics."""
    return hasattr(module, "_is_expert_parallel")


def routed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` built with transformers' ``use_experts_implementation``, by name."""
    return {name: module for name, module in model.named_modules() if is_routed_experts(module)}


def own_experts(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """A model's own routed-experts modules, not built with ``use_experts_implementation`` but with its contract
    (``forward(hidden_states, top_k_index, top_k_weights)``, an int ``num_experts``) and every parameter under them
    stacked over those experts on dim 0, expert-major, the same number of rows each (DBRX's ``DbrxExperts``), by
    name: (module, rows per expert)."""
    found = {}
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if is_routed_experts(module) or not isinstance(experts, int) or experts < 1 or \
                tuple(inspect.signature(type(module).forward).parameters)[1:4] != ROUTING:
            continue
        rows = {p.shape[0] // experts if p.dim() >= 2 and p.shape[0] % experts == 0 else 0
                for p in module.parameters()}
        if len(rows) == 1 and 0 not in rows:
            found[name] = (module, rows.pop())
    return found


def expert_major_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules that take every expert's copy of every token, expert-major, by name: ``forward(
    hidden_states)`` alone, an int ``num_experts``, and parameters of their own only, each 3-D and stacked on dim 0
    over those experts (Llama 4's ``Llama4TextExperts``, whose MoE block weights each copy by its routing score)."""
    found = {}
    for name, module in model.named_modules():
        experts, params = getattr(module, "num_experts", None), list(module.parameters(recurse=False))
        if isinstance(experts, int) and experts > 0 and params and \
                tuple(inspect.signature(type(module).forward).parameters)[1:] == ("hidden_states",) and \
                len(params) == len(list(module.parameters())) and \
                all(p.dim() == 3 and p.shape[0] == experts for p in params):
            found[name] = module
    return found


def plan_expert_parallel(model: nn.Module, config: ParallelConfig, world_size: int | None = None) -> EPPlan | None:
    """The EP plan for ``model`` at ``config`` (None at ep=1); ConfigError naming the module and the fix when the
    model's experts cannot be divided."""
    if config.ep == 1:
        return None
    model_type = getattr(model.config, "model_type", type(model).__name__)
    found = routed_experts(model)
    own = own_experts(model)
    if own and not found:
        return _own_plan(model_type, own, config, world_size)
    major = expert_major_experts(model)
    if major and not found:
        if config.moe_capacity_factor is not None:
            raise ConfigError(f"moe_capacity_factor={config.moe_capacity_factor} has no effect on {model_type}: its "
                              f"experts ({type(next(iter(major.values()))).__name__}) compute every token, none is "
                              f"routed past a capacity; drop it")
        plan = _own_plan(model_type, {name: (module, 1) for name, module in major.items()}, config, world_size)
        return dataclasses.replace(plan, expert_major=True)
    if not found:
        other = other_experts(model)
        if other:
            module = model.get_submodule(other)
            arguments = ", ".join(tuple(inspect.signature(type(module).forward).parameters)[1:])
            if arguments.startswith(", ".join(ROUTING)):
                shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
                raise ConfigError(
                    f"ep={config.ep}: {other} ({type(module).__name__}) takes routing (forward({arguments})) but its "
                    f"parameters {shapes} are not each stacked on dim 0 over one count of experts it names in "
                    f"num_experts (experts without weights, such as zero-compute ones, are not divided with them); "
                    f"use ep=1 for {model_type}")
            raise ConfigError(
                f"ep={config.ep}: {other} ({type(module).__name__}) holds experts stacked on dim 0, but its "
                f"forward({arguments}) takes no routing (not transformers' forward(hidden_states, top_k_index, "
                f"top_k_weights)), so its tokens cannot be dispatched; use ep=1 for {model_type}"
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
        raise ConfigError(f"{model_type} has {experts} experts per MoE layer, not divisible by ep={config.ep}; "
                          f"{_ep_choices(experts, config, world_size)}")
    return EPPlan(config.ep, tuple(found), experts, config.moe_capacity_factor)


def _ep_choices(experts: int, config: ParallelConfig, world_size: int | None) -> str:
    """The ep sizes to offer: divisors of the expert count and, where the world is known, of the dp x cp ranks ep
    is carved from (an ep dividing the experts alone was then refused for the ranks)."""
    carved = world_size // (config.tp * config.pp) if world_size else None
    choices = [d for d in range(1, experts + 1) if experts % d == 0 and (carved is None or carved % d == 0)]
    return f"choose ep among {choices}" + (f" (dividing both the experts and dp*cp = {carved})" if carved else "")


def _own_plan(model_type: str, own: dict[str, tuple[nn.Module, int]], config: ParallelConfig,
              world_size: int | None) -> EPPlan:
    """The EP plan over a model's own experts modules (``own_experts``)."""
    counts = {module.num_experts for module, _ in own.values()}
    if len(counts) > 1:
        raise ConfigError(f"{model_type}: MoE layers with different expert counts {sorted(counts)}; use ep=1")
    experts = counts.pop()
    if experts % config.ep:
        raise ConfigError(f"{model_type} has {experts} experts per MoE layer, not divisible by ep={config.ep}; "
                          f"{_ep_choices(experts, config, world_size)}")
    rows = tuple((name, per) for name, (_, per) in own.items() if per != 1)
    return EPPlan(config.ep, tuple(own), experts, config.moe_capacity_factor, rows)


def other_experts(model: nn.Module, skip: Collection[str] = ()) -> str | None:
    """The first module (not one of ``skip``) whose own parameters are stacked over experts (3-D, in a module named
    like experts or counting them in ``num_experts``) without an experts interface plait divides (JetMoE's
    ``JetMoeParallelExperts``, ``forward(inputs, expert_size)``). Not every 3-D parameter stacks experts: RWKV's
    time_mix_key [1, 1, H], XLNet's mask_emb, a convolution's kernel."""
    for name, module in model.named_modules():
        stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        counted = getattr(module, "num_experts", None)
        if name not in skip and stacked and ("expert" in name.rpartition(".")[2] or counted == stacked[0].shape[0]):
            return name
    return None
