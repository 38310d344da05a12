"""Sequence parallelism (Korthikanti et al. 2022): between the TP regions, activations live on sequence
shards, so norms, dropout and residual adds do 1/tp of the work and hold 1/tp of the activations.

The region starts at the first decoder layer's input, after transformers has built position ids, rotary
tables and the causal mask from the full sequence (docs/decisions.md D2: starting at the embedding breaks
rotary), and ends at the final norm's output. Inside it, column-parallel layers all-gather their input and
row-parallel layers reduce-scatter their output (tp/layers.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from plait.base import comm
from plait.base.config import ConfigError
from plait.base.patterns import matches
from plait.tp import mappings
from plait.tp.plans import SPPlan
from plait.tp.sharding import ModuleShard
from plait.tp.styles import WholeExperts


def region_prefix(begin: str) -> str:
    """``model.layers.0`` -> ``model.layers.``: the repeated blocks all run on sequence shards."""
    return begin.rpartition(".")[0] + "."


def sp_grad_sum_params(model: nn.Module, plan: SPPlan, shards: dict[str, ModuleShard]) -> list[nn.Parameter]:
    """Replicated parameters that see only a sequence shard, so their gradients must be summed over tp.

    Raises ConfigError for a replicated parameter inside the region that the plan does not account for:
    its gradient would silently differ between ranks.
    """
    modules = dict(model.named_modules())
    for required in (plan.begin, plan.end):
        if required not in modules:
            raise ConfigError(f"the SP plan names {required!r}, but the model has no such module")
    prefix = region_prefix(plan.begin)
    found: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        in_region = name.startswith(prefix) or module_name == plan.end
        if not in_region:
            continue
        shard = shards.get(module_name)
        if shard is not None and shard.spec(leaf) is not None and shard.spec(leaf).dim is not None:
            continue  # sharded over tp: each rank owns its gradient
        if shard is not None and isinstance(shard.style, WholeExperts):
            continue  # routed experts kept whole: their rule sums them over the tp group
        if shard is not None and leaf == "bias":
            found.append(param)  # row-parallel bias, added after the reduce-scatter
        elif any(matches(pattern, module_name) for pattern in plan.norms):
            found.append(param)
        else:
            raise ConfigError(
                f"parameter {name} is replicated inside the sequence-parallel region but the SP plan does not "
                f"name its module; add a pattern for {module_name!r} to SPPlan.norms (or shard it in the TP plan)"
            )
    return found


def install_sequence_parallel(
    model: nn.Module, plan: SPPlan, group: dist.ProcessGroup | None, head_is_parallel: bool,
    owns: Callable[[str], bool] = lambda name: True,
) -> list[torch.utils.hooks.RemovableHandle]:
    """Split the sequence at ``plan.begin``'s input and gather it at ``plan.end``'s output.

    The gather's backward reduce-scatters when a vocab-parallel head consumes it (each rank's input
    gradient is a partial sum over its vocab slice) and merely splits when the head is replicated.
    Under pipeline parallelism a rank ``owns`` only some modules: the split happens only on the stage
    holding ``plan.begin``, the gather on the one holding ``plan.end``; between stages the hidden states
    travel as sequence shards.
    """

    def scatter(module, args, kwargs):
        if args:
            return (mappings.scatter_to_seq(args[0], group), *args[1:]), kwargs
        kwargs["hidden_states"] = mappings.scatter_to_seq(kwargs["hidden_states"], group)
        return args, kwargs

    def gather(module, args, output):
        if isinstance(output, torch.Tensor):
            return mappings.gather_from_seq(output, group, head_is_parallel)
        return (mappings.gather_from_seq(output[0], group, head_is_parallel), *output[1:])

    handles = []
    if owns(plan.begin):
        handles.append(model.get_submodule(plan.begin).register_forward_pre_hook(scatter, with_kwargs=True))
    if owns(plan.end):
        handles.append(model.get_submodule(plan.end).register_forward_hook(gather))
    if plan.side_inputs:
        layers = region_prefix(plan.begin).rstrip(".")
        for index, layer in enumerate(model.get_submodule(layers)):
            if owns(f"{layers}.{index}"):  # after the begin hook: the hidden states are a shard already
                hook = SideInputScatter(f"{layers}.{index}", layer, plan.side_inputs, group)
                handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


class SideInputScatter:
    """A decoder layer's forward pre-hook handing it this rank's sequence shard of ``names`` (``SPPlan.side_inputs``),
    by keyword or by position in its forward's signature. The model computed them before its layers on the whole
    sequence, on every rank alike; the scatter's backward all-gathers their gradient, so whatever computed them
    gets the whole sequence's gradient on every rank, as in one process. A value not shaped [batch, sequence,
    features] like the hidden states (a bias over heads and pairs of tokens) is a ConfigError, not a silent slice."""

    def __init__(self, name: str, layer: nn.Module, names: tuple[str, ...], group: dist.ProcessGroup | None) -> None:
        params = list(inspect.signature(layer.forward).parameters)
        self.name, self.names, self.group = name, names, group
        self.positions = {n: params.index(n) for n in names if n in params}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        args = list(args)
        for name in self.names:
            position = self.positions.get(name)
            if name in kwargs:
                kwargs[name] = self._split(name, kwargs[name], hidden)
            elif position is not None and position < len(args):
                args[position] = self._split(name, args[position], hidden)
        return tuple(args), kwargs

    def _split(self, name: str, value, hidden: torch.Tensor):
        if not isinstance(value, torch.Tensor):
            return value  # None: a config without it (Gemma 4 with hidden_size_per_layer_input=0)
        shards = comm.group_size(self.group)
        if value.dim() != hidden.dim() or value.shape[0] != hidden.shape[0] or \
                value.shape[mappings.SEQ_DIM] != hidden.shape[mappings.SEQ_DIM] * shards:
            raise ConfigError(f"{self.name}: its argument {name} has shape {tuple(value.shape)}, not one value per "
                              f"token like the hidden states' shard {tuple(hidden.shape)} over {shards} ranks; "
                              f"sequence parallelism cannot split it: disable sequence parallelism")
        return mappings.scatter_to_seq(value, self.group)
