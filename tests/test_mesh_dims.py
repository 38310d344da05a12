"""The mesh's groups come from its named dimensions (plait.base.mesh.DIMS): the ranks of each group differ along
that dimension alone and cover it, the replica group (dp x cp) along those two, and every rank is in exactly one
row of each; tp ranks are adjacent (the chattiest group on one node), then cp."""

from __future__ import annotations

import itertools

import torch

from plait.base.mesh import DIMS, ranks_along


def coordinates(grid: torch.Tensor) -> dict[int, tuple[int, ...]]:
    return {int(grid[index]): index for index in itertools.product(*(range(n) for n in grid.shape))}


def test_each_group_varies_along_its_dimensions_alone():
    for sizes in itertools.product((1, 2, 3), (1, 2), (1, 2), (1, 2, 4)):
        grid = torch.arange(torch.Size(sizes).numel()).view(sizes)
        at = coordinates(grid)
        for names in [(name,) for name in DIMS] + [("dp", "cp")]:
            rows = ranks_along(grid, names).tolist()
            assert sorted(r for row in rows for r in row) == list(range(grid.numel())), (sizes, names)
            fixed = [i for i, name in enumerate(DIMS) if name not in names]
            for row in rows:
                assert len(row) == torch.Size(sizes[DIMS.index(n)] for n in names).numel()
                assert len({tuple(at[r][i] for i in fixed) for r in row}) == 1, (sizes, names, row)


def test_tp_ranks_are_adjacent_then_cp():
    grid = torch.arange(16).view(1, 2, 2, 4)  # dp, pp, cp, tp
    assert ranks_along(grid, ("tp",)).tolist()[0] == [0, 1, 2, 3]
    assert ranks_along(grid, ("cp",)).tolist()[0] == [0, 4]
    assert ranks_along(grid, ("pp",)).tolist()[0] == [0, 8]
