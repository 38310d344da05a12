"""Next-token prediction: language modelling on plain-text blocks and SFT on blocks with masked labels.

The loss is the cross-entropy summed over the global batch's labelled tokens, divided by their count
(``count_labels``): every layout and every split into micro-batches then gives one process's loss.
"""

from __future__ import annotations

import math

import torch

from plait.base import comm
from plait.base.mesh import Mesh
from plait.data.sft_blocks import batch_inputs, count_labels
from plait.parallel_model import ParallelModel
from plait.run.methods.base import TrainingMethod, micro_rows

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # input ids, labels, position ids (None: default)


class NextToken(TrainingMethod):
    """``blocks``: token blocks (a tensor or a token file) or SFT blocks; ``spans``: the token ranges of each
    block a context-parallel rank reads (None without cp)."""

    def __init__(self, blocks, spans: list[tuple[int, int]] | None = None) -> None:
        self.blocks, self.spans = blocks, spans

    def __len__(self) -> int:
        return len(self.blocks)

    def divisor(self, rows: torch.Tensor) -> int:
        return count_labels(self.blocks, rows)

    def micro_batches(self, rows: torch.Tensor, mesh: Mesh, accumulation: int, device: torch.device) -> list[Batch]:
        return [batch_inputs(self.blocks, micro, device, self.spans)
                for micro in micro_rows(rows, mesh, accumulation)]

    def before_step(self, pmodel: ParallelModel, batches: list[Batch], step: int) -> None:
        # --moe_aux_loss_scope global_batch: the load-balancing loss over every micro-step (a routing pass first)
        pmodel.set_global_batch([(ids, None, positions) for ids, _, positions in batches])

    def micro_step(self, pmodel: ParallelModel, batch: Batch, divisor: int) -> torch.Tensor:
        ids, labels, positions = batch
        return pmodel.train_step(ids, labels, num_items_in_batch=divisor, position_ids=positions)

    @torch.no_grad()
    def evaluate(self, pmodel: ParallelModel, data, batch_size: int, device: torch.device) -> dict[str, float]:
        """Mean loss and perplexity over every validation block, split over data-parallel ranks: the same number
        whatever the layout. Every dp rank runs as many whole pipeline microbatches (a ZeRO-3 or tp forward is
        collective), so the blocks are padded to a multiple of dp x microbatches with rows that carry no label
        (they once were cut to that multiple instead: an odd count evaluated one block less at dp=2)."""
        mesh = pmodel.mesh
        m = pmodel.config.num_microbatches
        padded = -(-len(data) // (mesh.dp * m)) * (mesh.dp * m)
        mine = torch.arange(padded)[mesh.dp_rank :: mesh.dp]
        num_items = count_labels(data, torch.arange(len(data)))
        batch_size = max(batch_size // m * m, m)
        total = torch.zeros((), device=device)
        pmodel.eval()
        for start in range(0, len(mine), batch_size):
            rows = mine[start : start + batch_size]
            ids, labels, positions = batch_inputs(data, rows.clamp(max=len(data) - 1), device)
            labels = labels.masked_fill((rows >= len(data)).to(device)[:, None], -100)  # padding: no label
            total += pmodel.eval_loss(ids, labels, num_items_in_batch=num_items, position_ids=positions)
        pmodel.train()
        loss = comm.all_reduce(total, mesh.replica_group).item()  # dp ranks' batches, cp ranks' tokens
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
