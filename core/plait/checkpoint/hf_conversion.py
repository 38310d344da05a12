"""A model directory's tensors under the names transformers loads them as, stacked experts as pieces.

transformers 5 holds a MoE layer's routed experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]), but ``save_pretrained`` and hub checkpoints store them one expert at a
time under the original names (``mlp.experts.3.gate_proj.weight`` [I, H]; Mixtral:
``block_sparse_moe.experts.3.w1.weight``). ``from_pretrained`` converts them with the model's conversion
mapping (``transformers.conversion_mapping``: renamings, then converters that stack and concatenate). Here the
same mapping is applied to the index instead of to tensors: a converted tensor becomes pieces of the stored ones
(expert 3's gate weight is the box [3:4, 0:I, 0:H] of ``gate_up_proj``), so the reader reads a rank's experts
and slices straight from the per-expert tensors, and a rank under expert parallelism reads only its experts'
bytes. Every family transformers converts this way is served by its own mapping, not a list kept here; an
operation that is not a stack on dim 0 or a concatenation (a split, transpose, permutation) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from transformers.core_model_loading import (
    Concatenate, MergeModulelist, WeightConverter, WeightRenaming, WeightTransform, dot_natural_key,
    rename_source_key,
)

from plait.base.config import ConfigError
from plait.checkpoint.format import Index, Piece, TensorEntry

Collected = TensorEntry | list[TensorEntry]  # a converter's value: one tensor, or a source pattern's list


def converted(index: Index, transforms: Sequence[WeightTransform], names: Collection[str], base_prefix: str) -> Index:
    """``index`` (a model directory's, under its stored names) under the model's ``names``, as
    ``from_pretrained`` names its tensors with ``transforms`` (``get_model_conversion_mapping``): each stored
    tensor renamed, each converter's target assembled from its stored sources. Stored tensors renamed to no
    name of ``names`` keep their new name (another pipeline stage's); converters whose target is in no name
    of ``names`` are skipped. ConfigError naming the tensor for a conversion plait cannot express as pieces."""
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    wanted = dict.fromkeys(names, True)  # rename_source_key asks ``wanted.get(name) is not None``
    prefix = base_prefix or None  # transformers' "no base model prefix"
    tensors: dict[str, TensorEntry] = {}
    sources: dict[str, dict[str, list[TensorEntry]]] = {}  # target -> source pattern -> stored tensors
    converter_of: dict[str, WeightConverter] = {}
    for key in sorted(index.tensors, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if name not in wanted and key in wanted:  # as from_pretrained: a key already the model's stays
            name, pattern = rename_source_key(key, [], [], prefix, wanted)
        if pattern is None:
            tensors[name] = index.tensors[key]
        elif name in wanted:
            sources.setdefault(name, {}).setdefault(pattern, []).append(index.tensors[key])
            converter_of[name] = by_pattern[pattern]
    for name, collected in sources.items():
        tensors[name] = _assemble(name, converter_of[name], collected)
    return dataclasses.replace(index, tensors=tensors)


def _assemble(name: str, converter: WeightConverter, values: Mapping[str, Collected]) -> TensorEntry:
    """The one tensor ``converter``'s operations make of ``values`` (source pattern -> stored tensors), as
    pieces of them; the operations act as transformers' do on tensors."""
    for op in converter.operations:
        if isinstance(op, MergeModulelist) and op.dim == 0:
            values = {p: v if isinstance(v, TensorEntry) else _stack(name, v) for p, v in values.items()}
        elif isinstance(op, Concatenate):
            parts = [e for p in converter.source_patterns if p in values
                     for e in (values[p] if isinstance(values[p], list) else [values[p]])]
            values = {converter.target_patterns[0]: _concatenate(name, parts, op.dim)}
        else:
            raise ConfigError(
                f"{name}: transformers converts it from {converter.source_patterns} with {op!r}, which plait "
                f"cannot read in slices (it reads stacks on dim 0 and concatenations); save the model's own "
                f"state_dict (safetensors.torch.save_file) to load it"
            )
    made = [v for v in values.values() if isinstance(v, TensorEntry)]
    if len(made) != 1 or len(values) != 1:
        raise ConfigError(
            f"{name}: {converter.operations} make {len(values)} tensors of {converter.source_patterns}, not one"
        )
    return made[0]


def _stack(name: str, entries: list[TensorEntry]) -> TensorEntry:
    """``torch.stack(entries)``: entry i is the box [i:i+1] of a new dim 0 (its stored tensors lack that dim)."""
    _same(name, entries, "stack", dim=None)
    pieces = [Piece(p.file, p.key, ((i, i + 1), *p.box), (0, *p.at)) for i, e in enumerate(entries) for p in e.pieces]
    return TensorEntry("param", entries[0].dtype, (len(entries), *entries[0].shape), pieces)


def _concatenate(name: str, entries: list[TensorEntry], dim: int) -> TensorEntry:
    """``torch.cat(entries, dim)``: each entry's pieces moved along ``dim`` by the sizes before it."""
    dim %= len(entries[0].shape)
    _same(name, entries, "concatenate", dim)
    pieces, offset = [], 0
    for entry in entries:
        for p in entry.pieces:
            box = tuple((a + offset, b + offset) if d == dim else (a, b) for d, (a, b) in enumerate(p.box))
            pieces.append(Piece(p.file, p.key, box, p.at))
        offset += entry.shape[dim]
    shape = tuple(offset if d == dim else s for d, s in enumerate(entries[0].shape))
    return TensorEntry("param", entries[0].dtype, shape, pieces)


def _same(name: str, entries: list[TensorEntry], verb: str, dim: int | None) -> None:
    """ConfigError unless ``entries`` share dtype and shape (but on ``dim``)."""
    if len({(e.dtype, tuple(s for d, s in enumerate(e.shape) if d != dim)) for e in entries}) > 1:
        found = sorted({f"{e.dtype}{list(e.shape)}" for e in entries})
        raise ConfigError(f"{name}: cannot {verb} its stored tensors of different dtypes or shapes {found}")
