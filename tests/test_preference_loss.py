"""plait's preference losses against TRL's own: TRL 1.16's ``DPOTrainer._compute_loss`` is run on the same per-token
log-probs (through a stand-in for its trainer state and model output, with reference log-probs precomputed, as
``--precompute_ref_log_probs`` gives them), and its loss and logged metrics are compared with plait's, for every loss
type plait offers and for a weighted combination."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.dpo_trainer import DPOTrainer

from plait.base.config import ConfigError
from plait.run.methods.preference_loss import LOSS_TYPES, PairLogps, PreferenceLoss

PAIRS, SEQ = 6, 12


def batch(seed: int = 0) -> dict:
    """Per-token log-probs of 6 chosen then 6 rejected sequences, completions of different lengths after prompts."""
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.zeros(2 * PAIRS, SEQ, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(2, 6, (1,), generator=g))
        stop = int(torch.randint(start + 1, SEQ + 1, (1,), generator=g))
        completion_mask[row, start:stop] = 1
    shift = completion_mask[:, 1:]
    log_probs = -torch.rand(2 * PAIRS, SEQ - 1, generator=g, dtype=torch.float64) * 3 * shift
    ref = -torch.rand(2 * PAIRS, SEQ - 1, generator=g, dtype=torch.float64) * 3 * shift
    return {"completion_mask": completion_mask, "log_probs": log_probs, "ref_logps": ref.sum(dim=1)}


def trl_loss(loss: PreferenceLoss, data: dict) -> tuple[float, dict[str, float]]:
    """TRL's ``_compute_loss`` on ``data``, with what it reads of the trainer and of the model's output stood in."""
    rows, width = data["log_probs"].shape
    output = SimpleNamespace(log_probs=data["log_probs"], entropy=torch.zeros(rows, width),
                             mean_logits=torch.zeros(rows, width), is_top1=torch.zeros(rows, width, dtype=torch.bool))
    model = SimpleNamespace(training=True)
    trainer = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                                 gather_for_metrics=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=list(loss.loss_type), loss_weights=list(loss.weights), beta=loss.beta,
        label_smoothing=loss.label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    ref_chosen, ref_rejected = data["ref_logps"].chunk(2)
    inputs = {"input_ids": torch.zeros(rows, width + 1, dtype=torch.long), "attention_mask": torch.ones(rows, width + 1),
              "completion_mask": data["completion_mask"], "ref_chosen_logps": ref_chosen,
              "ref_rejected_logps": ref_rejected}
    value = DPOTrainer._compute_loss(trainer, lambda **kwargs: output, inputs, return_outputs=False)
    return float(value), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def plait_loss(loss: PreferenceLoss, data: dict) -> tuple[float, dict[str, float]]:
    logps, counts = data["log_probs"].sum(dim=1), data["completion_mask"].sum(dim=1)
    pairs = PairLogps(*logps.chunk(2), *data["ref_logps"].chunk(2), *counts.chunk(2))
    sums = loss.metric_sums(pairs)
    chosen_tokens = data["completion_mask"][:PAIRS, 1:].sum()  # the labelled (shifted) chosen positions
    value = loss.per_pair(pairs).sum() / PAIRS - loss.sft_weight * logps[:PAIRS].sum() / chosen_tokens
    return float(value), {k: float(v / PAIRS) for k, v in sums.items()}


@pytest.mark.parametrize("loss", [PreferenceLoss(loss_type=(t,), beta=0.3,
                                                 label_smoothing=0.1 if t in ("robust", "exo_pair") else 0.0)
                                  for t in LOSS_TYPES] +
                         [PreferenceLoss(loss_type=("sigmoid", "bco_pair", "hinge"), loss_weights=(0.8, 0.2, 1.0)),
                          PreferenceLoss(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5))],
                         ids=list(LOSS_TYPES) + ["mpo", "rpo"])
def test_each_loss_and_metric_is_trls(loss):
    # float64 log-probs agree to 1e-12; exo_pair's to float32's rounding (3e-8 measured): TRL makes its epsilon a
    # float32 tensor, so log(1 - eps) and log(eps) carry float32 rounding into the float64 loss.
    rel = 1e-7 if "exo_pair" in loss.loss_type else 1e-12
    for seed in range(3):
        data = batch(seed)
        expected, expected_metrics = trl_loss(loss, data)
        got, metrics = plait_loss(loss, data)
        assert got == pytest.approx(expected, rel=rel, abs=1e-12), (seed, got, expected)
        for name, value in metrics.items():
            assert value == pytest.approx(expected_metrics[name], rel=1e-12, abs=1e-12), (name, value)


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--loss_type aot: unknown \(aot: its value depends on how the batch is "
                                          r"split over ranks\); choose from sigmoid, hinge"):
        PreferenceLoss(loss_type=("aot",))
    with pytest.raises(ConfigError, match=r"--loss_weights has 1 values for 2 loss types \(sigmoid,ipo\)"):
        PreferenceLoss(loss_type=("sigmoid", "ipo"), loss_weights=(1.0,))
    with pytest.raises(ConfigError, match=r"--label_smoothing=0.5 with the robust loss must lie in \[0, 0.5\)"):
        PreferenceLoss(loss_type=("robust",), label_smoothing=0.5)
    with pytest.raises(ConfigError, match=r"--beta=0 must be positive"):
        PreferenceLoss(beta=0)
