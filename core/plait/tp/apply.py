"""Apply shard decisions: swap modules for tensor-parallel layers, fix per-rank attention attributes, keep
tied weights tied, and report which parameters need their gradients summed over which group."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from plait.base.mesh import Mesh
from plait.tp.layers import TPRegionEntry
from plait.tp.sharding import ModuleShard, Part
from plait.tp.styles import BuildContext, VocabHead


@dataclass
class AppliedTP:
    """What applying TP left behind for the rest of plait."""

    entry: TPRegionEntry
    head_is_parallel: bool = False
    vocab_start: int = 0  # first vocab id of this rank's logits (0 when the head is replicated)
    vocab_per_rank: int = 0  # padded vocab rows per rank (vocab-parallel head only)
    vocab_size: int = 0  # the real vocabulary (vocab-parallel head only)
    # (parameter, group its gradient is summed over, the part summed: None for the whole gradient)
    grad_sums: list[tuple[nn.Parameter, dist.ProcessGroup | None, Part | None]] = field(default_factory=list)


def apply_tensor_parallel(model: nn.Module, shards: dict[str, ModuleShard], mesh: Mesh, sp: bool,
                          outside_sp: Callable[[str], bool] = lambda name: False) -> AppliedTP:
    """Replace each module of ``shards`` with its parallel layer. ``outside_sp``: the modules that run on whole
    inputs even under SP (an image-text model's vision tower and projector, before the language model): their
    layers are built as without SP, so a split vision attention does not gather its patches from every rank."""
    ctx = BuildContext(mesh, TPRegionEntry(mesh.tp_group, sp), sp)
    whole = BuildContext(mesh, TPRegionEntry(mesh.tp_group, False), False) if sp else ctx
    applied = AppliedTP(ctx.entry)
    tied: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        tied[id(param)].append((module_name, leaf))

    entered_parents: set[str] = set()
    for name, shard in shards.items():
        parent_name = shard.owner
        built = whole if outside_sp(name) else ctx
        if shard.entered_by_parent and parent_name not in entered_parents:
            model.get_submodule(parent_name).register_forward_pre_hook(_enter_input(built.entry), with_kwargs=True)
            entered_parents.add(parent_name)
        new = shard.style.build(shard, model.get_submodule(name), built)
        model.set_submodule(name, new)
        if isinstance(shard.style, VocabHead):
            applied.head_is_parallel, applied.vocab_start = True, shard.vocab_range[0]
            applied.vocab_size = shard.weight.full_shape[shard.weight.dim]
            applied.vocab_per_rank = shard.weight.local_shape[shard.weight.dim]
        if shard.grad_sum_block > 1:
            group = mesh.tp_block_group(shard.grad_sum_block)
            applied.grad_sums += [(p, group, _shared_part(new, p, shard)) for p in _summed(new, shard)]
        for attr, value in shard.local_attrs.items():
            setattr(model.get_submodule(parent_name), attr, value)
        if shard.head_inputs:
            owner = model.get_submodule(parent_name)
            owner.register_forward_pre_hook(_slice_head_inputs(owner, shard.head_inputs), with_kwargs=True)

    _retie(model, shards, [places for places in tied.values() if len(places) > 1])
    return applied


def _summed(module: nn.Module, shard: ModuleShard) -> list[nn.Parameter]:
    """The parameters whose gradients ``shard`` sums: a block's own ones that it names (DiffLlama's attention keeps
    its lambda vectors whole, its projections have shards of their own), else every parameter of the module."""
    blocks = any(True for child in module.children() for _ in child.parameters())
    own = dict(module.named_parameters(recurse=False))
    return [own[leaf] for leaf in shard.params if leaf in own] if blocks and shard.params else list(module.parameters())


def _shared_part(module: nn.Module, param: nn.Parameter, shard: ModuleShard) -> Part | None:
    """The part of ``param`` (the module's weight or bias) whose gradient the block shares, where the shard shares
    only some of its ranges (``ModuleShard.shared_ranges``), else None (all of it)."""
    if not shard.shared_ranges:
        return None
    spec = shard.weight if param is module.weight else shard.bias
    return Part(spec.dim, spec.local_spans(shard.shared_ranges))


def _enter_input(entry: TPRegionEntry):
    """A forward pre-hook passing a module's ``hidden_states`` (first argument) through ``entry``, wherever the
    call passes that same tensor: CTRL's layer calls its attention as ``attn(normed, normed, normed)`` (its v, k
    and q), each of which a projection reads. Other arguments stay as they are."""

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        entered = entry(hidden)
        return (tuple(entered if a is hidden else a for a in args),
                {k: entered if v is hidden else v for k, v in kwargs.items()})

    return hook


def _slice_head_inputs(module: nn.Module, head_inputs: dict[str, tuple[int, int, int]]):
    """A forward pre-hook handing ``module`` only its heads of the arguments ``head_inputs`` names (dim 0 viewed as
    [groups, heads]; heads [first, stop) kept), by keyword or by position."""
    import inspect

    positions = {name: i - 1 for i, name in enumerate(inspect.signature(type(module).forward).parameters)}

    def narrow(value, heads: int, first: int, stop: int):
        if value is None:
            return None
        grouped = value.reshape(-1, heads, *value.shape[1:])
        return grouped[:, first:stop].reshape(-1, *value.shape[1:])

    def hook(module, args, kwargs):
        args = list(args)
        for name, (heads, first, stop) in head_inputs.items():
            if name in kwargs:
                kwargs[name] = narrow(kwargs[name], heads, first, stop)
            elif 0 <= positions.get(name, -1) < len(args):
                args[positions[name]] = narrow(args[positions[name]], heads, first, stop)
        return tuple(args), kwargs

    return hook


def _retie(model: nn.Module, shards: dict[str, ModuleShard], groups: list[list[tuple[str, str]]]) -> None:
    """Make parameters that were one tensor before sharding one tensor again (tied embeddings)."""
    for places in groups:
        specs = {shards[m].spec(leaf) if m in shards else None for m, leaf in places}
        if len(specs) > 1:
            names = [f"{m}.{leaf}" for m, leaf in places]
            raise ValueError(
                f"tied parameters {names} would be sharded differently ({specs}); give them the same TP style "
                f"(VocabEmbedding + VocabHead) or keep both replicated"
            )
        first_module, first_leaf = places[0]
        shared = getattr(model.get_submodule(first_module), first_leaf)
        for module_name, leaf in places[1:]:
            setattr(model.get_submodule(module_name), leaf, shared)
