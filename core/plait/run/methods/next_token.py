"""Next-token prediction: language modelling on plain-text blocks and SFT on blocks with masked labels.

The loss is the cross-entropy summed over the global batch's labelled tokens, divided by their count
(``count_labels``): every layout and every split into micro-batches then gives one process's loss.
"""

from __future__ import annotations

import torch

from plait.base.mesh import Mesh
from plait.data import local_microbatch
from plait.data.sft_blocks import batch_inputs, count_labels
from plait.parallelize import ParallelModel
from plait.run.methods.base import TrainingMethod

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
        return [batch_inputs(self.blocks, local_microbatch(rows, mesh.dp_rank, mesh.dp, accumulation, micro), device,
                             self.spans) for micro in range(accumulation)]

    def before_step(self, pmodel: ParallelModel, batches: list[Batch]) -> None:
        # --moe_aux_loss_scope global_batch: the load-balancing loss over every micro-step (a routing pass first)
        pmodel.set_global_batch([(ids, None, positions) for ids, _, positions in batches])

    def micro_step(self, pmodel: ParallelModel, batch: Batch, divisor: int) -> torch.Tensor:
        ids, labels, positions = batch
        return pmodel.train_step(ids, labels, num_items_in_batch=divisor, position_ids=positions)
