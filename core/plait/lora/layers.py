"""LoRA on plait's layers: A and B registered on the base layer (``<base>.lora_A.weight``, peft's names) and a
forward hook adding ``scale * B(A(dropout(x)))`` to the base output, with the collectives of its base. On an
experts module's parameters (peft's ``target_parameters``) the factors sit under peft's names for them and the
module runs on the updated weights (``lora/experts.py``).

The base layer is left as it is (its class, its parameter names, its hooks), so tensor, sequence and pipeline
parallelism, activation checkpointing and checkpoints see the same modules with LoRA or without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from plait.base.mesh import Mesh
from plait.base.seeds import init_seed
from plait.lora import experts, switch
from plait.lora.layout import LORA_A, LORA_B, WRAPPER, LoraPlan
from plait.tp import mappings
from plait.tp.sharding import Part

if TYPE_CHECKING:
    from plait.ep.layout import EPPlan


class LoraWeight(nn.Module):
    """Holds one LoRA matrix as ``weight`` so that its name is peft's (``q_proj.lora_A.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def extra_repr(self) -> str:
        return f"local={tuple(self.weight.shape)}"


class LoraDropout(nn.Dropout):
    """Dropout on a LoRA input, on the right stream under TP (tp/rng.py): the input of a column-parallel base is
    replicated over tp (entered, or gathered from sequence shards), so every tp rank draws the same mask from the
    shared stream, even inside a per-rank region; the input of a row-parallel base holds this rank's features,
    so it draws from this rank's own stream. ``rng`` is set once the dropout streams exist (tp > 1)."""

    def __init__(self, p: float, replicated: bool) -> None:
        super().__init__(p)
        self.replicated, self.rng = replicated, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rng is None or not self.training:
            return super().forward(x)
        with self.rng.shared(x.device) if self.replicated else self.rng.distinct(x.device):
            return super().forward(x)


def full_init(name: str, shape: tuple[int, ...], init_b_zero: bool, seed: int) -> torch.Tensor:
    """The full LoRA matrix ``name`` as peft initialises it: kaiming-uniform (a=sqrt(5), nn.Linear's default)
    for A, zeros for B unless ``init_lora_weights=False``; drawn from a generator seeded by (seed, name) so
    every layout starts from the same adapter."""
    full = torch.empty(shape, dtype=torch.float32)
    if init_b_zero and name.endswith(f"{LORA_B}.weight"):
        return full.zero_()
    generator = torch.Generator().manual_seed(init_seed(seed, name))
    return nn.init.kaiming_uniform_(full, a=5 ** 0.5, generator=generator)


def local_init(plan: LoraPlan, name: str, spec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of LoRA parameter ``name`` at its initial value."""
    full = full_init(name, spec.full_shape, plan.config.init_lora_weights is True, seed)
    return spec.slice_full(full).to(dtype)


def apply_lora(
    model: nn.Module, plan: LoraPlan, mesh: Mesh, sequence_parallel: bool, owns, seed: int = 0,
    ep: EPPlan | None = None,
) -> tuple[list[tuple[nn.Parameter, object, Part | None]], list[nn.Parameter]]:
    """Freeze every parameter of ``model``, add this rank's LoRA matrices to its adapted modules and expert
    parameters (on the base weight's device; left empty on meta for ``materialize``). Returns the (parameter,
    group, part or None for all) whose gradients are summed over a group of tp ranks, and under ``ep`` the factors of
    this rank's experts (their gradients are summed over the expert-replica group, as the experts' own are)."""
    for param in model.parameters():
        param.requires_grad_(False)
    specs = plan.specs(mesh.tp_rank)
    if ep is not None:
        specs = ep.localize(specs, mesh.ep_rank)
    sums, expert_factors = [], []
    adapted: dict[str, dict[str, nn.Module]] = {}  # experts module -> {parameter: holder of its factors}
    for name, placed in plan.modules_by_rank[mesh.tp_rank].items():
        if not owns(placed.module):
            continue
        base = model.get_submodule(placed.module)
        if placed.parameter is None:
            weight, holder = base.weight, base
        else:
            weight = base.get_parameter(placed.parameter)
            holder = _holder(base, name.removeprefix(placed.module).count(f".{WRAPPER}"))
        for attr, pname in ((LORA_A, placed.a_name), (LORA_B, placed.b_name)):
            if weight.is_meta:
                local = torch.empty(specs[pname].local_shape, dtype=weight.dtype, device="meta")
            else:
                local = local_init(plan, pname, specs[pname], seed, weight.dtype).to(weight.device)
            setattr(holder, attr, LoraWeight(local))
        if placed.parameter is not None:
            adapted.setdefault(placed.module, {})[placed.parameter] = holder
            if ep is not None:
                expert_factors += [holder.lora_A.weight, holder.lora_B.weight]
        else:
            base.lora_dropout = LoraDropout(plan.config.lora_dropout, placed.kind != "row") \
                if plan.config.lora_dropout else nn.Identity()
            base.register_forward_hook(_row_hook(plan.scale, mesh, sequence_parallel) if placed.kind == "row"
                                       else _column_hook(plan.scale))
        b_part = Part(0, placed.b.local_spans(placed.b_shared)) if placed.b_shared else None
        for param, block, part in ((holder.lora_A.weight, placed.a_grad_sum, None),
                                   (holder.lora_B.weight, placed.b_grad_sum, b_part)):
            if block > 1:
                sums.append((param, mesh.tp_group if block == mesh.tp else mesh.tp_block_group(block), part))
    for module, factors in adapted.items():
        experts.install(model.get_submodule(module), factors, plan.scale)
    return sums, expert_factors


def _holder(module: nn.Module, wrappers: int) -> nn.Module:
    """The module holding the factors of one of ``module``'s parameters: ``module`` itself, or inside it an empty
    module for each of peft's ``wrappers`` around it, so that the factors have peft's names."""
    for _ in range(wrappers):
        if not hasattr(module, WRAPPER):
            setattr(module, WRAPPER, nn.Module())
        module = getattr(module, WRAPPER)
    return module


def _column_hook(scale: float):
    """A column-parallel (or whole) base: A on the entered input (the base's ``entry`` remembers it, so this
    is the same tensor, gathered once under SP), B's rows are the base's output features."""

    def hook(module, args, output):
        if not switch.active():
            return output
        x = args[0]
        entry = getattr(module, "entry", None)
        if entry is not None:
            x = entry(x)
        update = F.linear(F.linear(module.lora_dropout(x), module.lora_A.weight), module.lora_B.weight)
        return output + update * scale

    return hook


def _row_hook(scale: float, mesh: Mesh, sequence_parallel: bool):
    """A row-parallel base: A on this rank's input features; the partial rank-r result is summed over tp
    (reduce-scattered to sequence shards under SP), as the base output is, before B."""

    def hook(module, args, output):
        if not switch.active():
            return output
        low = F.linear(module.lora_dropout(args[0]), module.lora_A.weight)
        if sequence_parallel:
            low = mappings.reduce_scatter_to_seq(low, mesh.tp_group)
        else:
            low = mappings.reduce_from_tp(low, mesh.tp_group)
        return output + F.linear(low, module.lora_B.weight) * scale

    return hook
