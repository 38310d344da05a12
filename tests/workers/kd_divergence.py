"""One rank of a 2-rank tp group: distillation's divergences on vocabulary slices, in float64, against the whole
vocabulary on one rank. Every rank draws the same student and teacher logits, keeps its half of the vocabulary and
computes each divergence through ``Logits`` (tp group: the world); rank 0 writes, per kind, the largest relative
difference of the summed divergence and of this rank's slice of the gradient from the whole-vocabulary ones."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from plait.run.methods.kd import divergence
from plait.tp.logprobs import Logits


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 6, 16, generator=gen, dtype=torch.float64) * 3
    teacher = torch.randn(2, 6, 16, generator=gen, dtype=torch.float64) * 3
    labels, rows = torch.zeros(2, 6, dtype=torch.long), torch.arange(2)
    width = student.shape[-1] // size
    cut = slice(rank * width, (rank + 1) * width)
    found = {}
    for kind in ("fkl", "rkl", "jsd"):
        whole = student.clone().requires_grad_()
        expected = divergence(Logits(whole, labels, rows), teacher, kind, 0.3, 1.7)
        expected.sum().backward()
        part = student[..., cut].clone().requires_grad_()
        got = divergence(Logits(part, labels, rows, rank * width, dist.group.WORLD), teacher[..., cut], kind, 0.3, 1.7)
        got.sum().backward()
        found[kind] = {"value": ((got - expected).abs().max() / expected.abs().max()).item(),
                       "grad": ((part.grad - whole.grad[..., cut]).abs().max() / whole.grad.abs().max()).item()}
    if rank == 0:
        with open(out, "w") as file:
            json.dump(found, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
