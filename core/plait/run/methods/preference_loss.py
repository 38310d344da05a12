"""The preference losses of DPO and its family, as TRL 1.16's DPOTrainer defines them, from sequence log-probs.

Each loss is a function of one pair's four numbers: the policy's and the reference's summed log-probs of the chosen
and of the rejected completion (plus, for the length-normalised ``ipo`` and ``sigmoid_norm``, each completion's token
count). A pair's loss is ``sum(weight * loss_type's loss)`` over ``loss_type`` (TRL's multi-loss combination, MPO's
form); a batch's is the mean over its pairs. Computed per pair, the mean over a global batch is the sum of every
rank's pairs divided by the global pair count, so any split over data-parallel ranks and micro-steps gives one
process's loss. TRL's ``sft`` term (RPO: the chosen completions' negative log-likelihood, ``--loss_type
sigmoid,sft``) is a mean over the batch's chosen tokens, not over pairs: it is ``sft_weight`` x their summed log-prob
over the global batch's chosen-token count (``DPO`` counts them), which on one process is TRL's mean. TRL's losses that
sort a batch (``aot``, ``aot_unpaired``) or read a batch statistic (``discopop``'s tau, WPO weighting) depend on how
the batch is cut and are not offered.

The metrics carry TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``), as sums over pairs to be divided by the global count.
tests/test_preference_loss.py holds every loss and metric to TRL's own code on the same log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.base.config import ConfigError
from plait.base.words import no_effect

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "apo_zero", "apo_down", "nca_pair", "bco_pair", "sppo_hard",
              "sigmoid_norm", "exo_pair", "sft")
BATCH_DEPENDENT = ("aot", "aot_unpaired", "discopop")  # TRL's, refused here (module docstring)
SMOOTHED = ("robust", "exo_pair")  # the loss types that read label_smoothing (TRL 1.16's DPOTrainer)


@dataclass(frozen=True)
class PairLogps:
    """Per pair [pairs]: summed completion log-probs of the policy and the reference, and completion lengths."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    nll: torch.Tensor | None = None  # the chosen rows' log-probs the NLL term averages (default: the completions')

    @property
    def nll_chosen(self) -> torch.Tensor:
        return self.chosen if self.nll is None else self.nll


@dataclass(frozen=True)
class PreferenceLoss:
    """TRL's ``beta``, ``loss_type`` (one or several), ``loss_weights`` (default 1.0 each) and ``label_smoothing``."""

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        unknown = [t for t in self.loss_type if t not in LOSS_TYPES]
        if unknown or not self.loss_type:
            why = (f" ({', '.join(t for t in unknown if t in BATCH_DEPENDENT)}: its value depends on how the batch is "
                   f"split over ranks)") if set(unknown) & set(BATCH_DEPENDENT) else ""
            raise ConfigError(f"--loss_type {','.join(self.loss_type) or '(none)'}: unknown{why}; choose from "
                              f"{', '.join(LOSS_TYPES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ConfigError(f"--loss_weights has {len(self.loss_weights)} values for {len(self.loss_type)} loss "
                              f"types ({','.join(self.loss_type)}); give one weight per type")
        if self.beta <= 0:
            raise ConfigError(f"--beta={self.beta} must be positive (the strength of the pull to the reference)")
        self._check_label_smoothing()

    def _check_label_smoothing(self) -> None:
        """TRL 1.16's DPO reads ``label_smoothing`` in its robust and exo_pair losses only (its sigmoid is no longer
        cDPO's), so with none of them a value is refused as doing nothing. Where read it is the probability that a
        preference label is wrong, in [0, 0.5): TRL's range for robust (which divides by 1 - 2 eps); exo_pair needs it
        > 0 (TRL: log(eps)), and from 0.5 on its target would prefer the rejected completion."""
        eps, reading = self.label_smoothing, [t for t in self.loss_type if t in SMOOTHED]
        if eps and not reading:
            raise ConfigError(no_effect(["--label_smoothing"], f" with --loss_type {','.join(self.loss_type)} (TRL's "
                                        f"DPO reads it in the robust and exo_pair losses only)",
                                        ", or use --loss_type robust or exo_pair"))
        for loss_type in reading:
            if not 0.0 <= eps < 0.5:
                raise ConfigError(f"--label_smoothing={eps} with the {loss_type} loss must lie in [0, 0.5) (the "
                                  f"probability that a preference label is flipped)")
        if "exo_pair" in self.loss_type and eps <= 0.0:
            raise ConfigError("the exo_pair loss needs --label_smoothing > 0 (the EXO paper recommends 1e-3)")

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.loss_type)

    @property
    def sft_weight(self) -> float:
        """The weight of TRL's ``sft`` term (0 without it): times the chosen tokens' mean negative log-likelihood."""
        return sum(w for t, w in zip(self.loss_type, self.weights) if t == "sft")

    def per_pair(self, p: PairLogps) -> torch.Tensor:
        """Each pair's loss [pairs]: the weighted sum of its loss types' (``sft`` aside: a per-token term)."""
        return sum((w * self._one(t, p) for t, w in zip(self.loss_type, self.weights) if t != "sft"),
                   torch.zeros_like(p.chosen))

    def _one(self, loss_type: str, p: PairLogps) -> torch.Tensor:
        beta, eps = self.beta, self.label_smoothing
        chosen_ratio, rejected_ratio = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected
        delta = chosen_ratio - rejected_ratio
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type in ("ipo", "sigmoid_norm"):  # per-token averages of the log-ratios
            average = chosen_ratio / p.chosen_tokens.clamp(min=1) - rejected_ratio / p.rejected_tokens.clamp(min=1)
            return (average - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * average)
        if loss_type == "robust":
            return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        if loss_type == "apo_zero":
            return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * delta)
        if loss_type == "nca_pair":
            chosen, rejected = beta * chosen_ratio, beta * rejected_ratio
            return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        if loss_type == "sppo_hard":
            return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        # exo_pair: KL(p_f || p_rh) over {chosen, rejected} with p_rh = [1 - eps, eps]
        log_chosen, log_rejected = F.logsigmoid(beta * delta), F.logsigmoid(-beta * delta)
        return log_chosen.exp() * (log_chosen - math.log1p(-eps)) + log_rejected.exp() * (log_rejected - math.log(eps))

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics' names, in the order ``metric_sums`` may be summed in."""
        return METRICS

    @staticmethod
    def metric_means(sums: dict[str, float], pairs: int, chosen_tokens: int) -> dict[str, float]:
        """The metrics from their sums over ``pairs`` pairs (whose chosen completions hold ``chosen_tokens``)."""
        return {name: value / pairs for name, value in sums.items()}

    def metric_sums(self, p: PairLogps) -> dict[str, torch.Tensor]:
        """TRL's metrics of these pairs as sums over them (divide by the global pair count after summing ranks)."""
        chosen, rejected = self.beta * (p.chosen - p.ref_chosen), self.beta * (p.rejected - p.ref_rejected)
        return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
                "rewards/accuracies": (chosen > rejected).float().sum(), "rewards/margins": (chosen - rejected).sum(),
                "logps/chosen": p.chosen.sum(), "logps/rejected": p.rejected.sum()}
