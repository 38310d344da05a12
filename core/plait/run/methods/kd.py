"""Distillation from a teacher (``plait train --method kd``): next-token data, a frozen teacher on the same mesh.

The teacher (--teacher_model_name_or_path: the same vocabulary as the student, any size and depth) is laid out on
the student's layout and read forward-only on each micro-batch first; its logits are kept where the student's loss
is computed (the last pipeline stage; this rank's vocabulary slice under tp, its sequence slice under cp). The
student's loss on the micro-batch's labelled tokens is ``(1 - kd_ratio) x cross-entropy + kd_ratio x divergence``
(NeMo AutoModel's weighting), each summed over the tokens and divided by the global batch's labelled-token count, so
every layout and split gives one process's loss. The divergence per token is TRL's ``generalized_jsd_loss`` (GKD):
``fkl`` = KL(teacher || student) (TRL's beta 0), ``rkl`` = KL(student || teacher) (beta 1), ``jsd`` = the
generalized Jensen-Shannon divergence with --kd_beta, on logits divided by --kd_temperature. Under tp it is computed
on the vocabulary slices (``Logits.log_softmax``, ``vocab_sum``): no rank gathers the vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plait.base.meta import build_meta_model
from plait.checkpoint.materialize import resolve_source
from plait.parallel_model import ParallelModel
from plait.run.methods.frozen import SecondModel, check_vocabulary, frozen_on_mesh, read_rows
from plait.run.methods.next_token import Batch, NextToken
from plait.tp.logprobs import Logits
from plait.tp.loss import IGNORE_INDEX



def divergence(logits: Logits, teacher: torch.Tensor, kind: str, beta: float, temperature: float) -> torch.Tensor:
    """Per position [rows, seq]: the divergence ``kind`` between the teacher's and the student's distributions over
    the whole vocabulary (as TRL's generalized_jsd_loss: beta 0 is ``fkl``, beta 1 ``rkl``)."""
    student = logits.log_softmax(temperature=temperature)
    target = logits.log_softmax(teacher, temperature=temperature)
    if kind == "fkl":
        return logits.vocab_sum(target.exp() * (target - student))
    if kind == "rkl":
        return logits.vocab_sum(student.exp() * (student - target))
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), target + math.log(beta)]), dim=0)
    towards_teacher = logits.vocab_sum(target.exp() * (target - mixture))
    towards_student = logits.vocab_sum(student.exp() * (student - mixture))
    return beta * towards_teacher + (1 - beta) * towards_student


class Distillation(NextToken):
    """Next-token data (text or SFT blocks) with a teacher: see the module docstring."""

    def __init__(self, blocks, spans, teacher: ParallelModel, kind: str, beta: float, temperature: float,
                 ratio: float) -> None:
        super().__init__(blocks, spans)
        self.teacher, self.kind, self.beta, self.temperature, self.ratio = teacher, kind, beta, temperature, ratio

    @classmethod
    def load_data(cls, args: Any, model_config: Any, plan: Any) -> None:
        check_vocabulary("--teacher_model_name_or_path", args.teacher_model_name_or_path, "teacher", "student",
                         model_config)
        return None  # the student's next-token data

    @classmethod
    def second_model(cls, args: Any, model: Any, dtype: torch.dtype) -> SecondModel:
        teacher = build_meta_model(resolve_source(args.teacher_model_name_or_path)[0], dtype)
        return SecondModel(teacher, "distillation's teacher", keeps_logits=True)

    @classmethod
    def create(cls, trainer: Any) -> "Distillation":
        args = trainer.args
        teacher = frozen_on_mesh(args.teacher_model_name_or_path, args, trainer.pmodel, trainer.device)
        return cls(trainer.blocks, trainer.spans, teacher, args.kd_loss, args.kd_beta, args.kd_temperature,
                   args.kd_ratio)

    def micro_step(self, pmodel: ParallelModel, batch: Batch, divisor: int) -> torch.Tensor:
        ids, labels, positions = batch
        # its logits, this rank's slices [rows, seq slice, vocab slice] (None where no loss is computed)
        teacher = read_rows(self.teacher, ids, labels, lambda logits: logits.values, positions)
        return pmodel.train_step(ids, labels, num_items_in_batch=divisor, position_ids=positions,
                                 objective=self._objective(teacher, divisor))

    def _objective(self, teacher: torch.Tensor, divisor: int):
        def objective(logits: Logits) -> torch.Tensor:
            labelled = logits.labels != IGNORE_INDEX
            per_token = divergence(logits, teacher[logits.rows], self.kind, self.beta, self.temperature)
            kd = (per_token * labelled).sum() / divisor
            if self.ratio == 1.0:
                return kd
            cross_entropy = -logits.label_logps().sum() / divisor
            return (1 - self.ratio) * cross_entropy + self.ratio * kd
        return objective
