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
from plait.run.methods.reference_free import CPOLoss

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


NOT_SMOOTHED = [t for t in LOSS_TYPES if t not in ("robust", "exo_pair")]


@pytest.mark.parametrize("loss_type", NOT_SMOOTHED)
def test_label_smoothing_where_trl_does_not_read_it_is_refused(loss_type):
    """TRL 1.16's DPO reads label_smoothing in robust and exo_pair only (its sigmoid is no longer cDPO's): TRL's loss
    is the same with and without it, so plait refuses it as doing nothing (it was accepted, even an invalid 0.6)."""
    data = batch(1)
    plain, smoothed = (trl_loss(SimpleNamespace(loss_type=(loss_type,), weights=(1.0,), beta=0.3, label_smoothing=eps),
                                data)[0] for eps in (0.0, 0.3))
    assert smoothed == plain
    with pytest.raises(ConfigError, match=rf"^--label_smoothing has no effect with --loss_type {loss_type} \(TRL's DPO "
                                          r"reads it in the robust and exo_pair losses only\); drop it, or use "
                                          r"--loss_type robust or exo_pair$"):
        PreferenceLoss(loss_type=(loss_type,), label_smoothing=0.6)
    PreferenceLoss(loss_type=(loss_type, "robust"), label_smoothing=0.1)  # read by one of the losses: taken


@pytest.mark.parametrize("loss_type, eps", [("robust", -0.1), ("exo_pair", 0.6), ("exo_pair", 1.0)])
def test_label_smoothing_outside_its_range_is_refused(loss_type, eps):
    """The probability that a label is flipped: [0, 0.5) (TRL's range for robust); exo_pair's log(eps) and
    log(1 - eps) made 1.0 a NaN loss, and from 0.5 on its target prefers the rejected completion."""
    with pytest.raises(ConfigError, match=rf"^--label_smoothing={eps} with the {loss_type} loss must lie in "
                                          r"\[0, 0\.5\)"):
        PreferenceLoss(loss_type=(loss_type,), label_smoothing=eps)


def trl_cpo_loss(loss: CPOLoss, pairs: PairLogps) -> torch.Tensor:
    """TRL's ``CPOTrainer.cpo_loss`` on the log-probs its forward gives it (per-token means for ipo and simpo)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = SimpleNamespace(alpha=0.0, accelerator=SimpleNamespace(device=torch.device("cpu")), beta=loss.beta,
                              loss_type=loss.loss_type, label_smoothing=loss.label_smoothing,
                              simpo_gamma=loss.simpo_gamma)
    return CPOTrainer.cpo_loss(trainer, *loss.logps(pairs))[0]


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo", "hinge", "ipo"])
def test_cpo_label_smoothing_is_trls_where_read_and_refused_where_not(loss_type):
    logps, counts = batch(2)["log_probs"].sum(dim=1), batch(2)["completion_mask"][:, 1:].sum(dim=1)
    pairs = PairLogps(*logps.chunk(2), *torch.zeros_like(logps).chunk(2), *counts.chunk(2))
    eps = 0.2 if loss_type in ("sigmoid", "simpo") else 0.0
    loss = CPOLoss(beta=0.5, loss_type=loss_type, label_smoothing=eps, simpo_gamma=0.7)
    assert torch.allclose(loss.per_pair(pairs), trl_cpo_loss(loss, pairs), rtol=1e-12, atol=1e-12)
    if eps:  # smoothed: a loss of its own (cDPO's), not the plain one
        assert not torch.allclose(loss.per_pair(pairs), CPOLoss(0.5, loss_type, 0.0, 0.7).per_pair(pairs))
        with pytest.raises(ConfigError, match=rf"^--label_smoothing=0.6 with the {loss_type} loss must lie in \[0, "):
            CPOLoss(beta=0.5, loss_type=loss_type, label_smoothing=0.6)
    else:  # TRL ignores it (with a warning): the same loss
        ignored = SimpleNamespace(beta=0.5, loss_type=loss_type, label_smoothing=0.3, simpo_gamma=0.7, logps=loss.logps)
        assert torch.equal(trl_cpo_loss(ignored, pairs), trl_cpo_loss(loss, pairs))
        with pytest.raises(ConfigError, match=rf"^--label_smoothing has no effect with --method cpo --loss_type "
                                              rf"{loss_type} \(TRL's CPO reads it in the sigmoid and simpo losses "
                                              rf"only\); drop it, or use --loss_type sigmoid or simpo$"):
            CPOLoss(beta=0.5, loss_type=loss_type, label_smoothing=0.1)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_simpo_gamma_without_the_simpo_loss_is_refused(loss_type):
    """--simpo_gamma is SimPO's target margin: the other CPO losses never read it (it was accepted)."""
    from plait.run.train_args import TrainArgs

    with pytest.raises(ConfigError, match=rf"^--simpo_gamma has no effect with --loss_type {loss_type} \(it is the "
                                          r"target margin of --loss_type simpo\); drop it, or use --loss_type simpo$"):
        TrainArgs(method="cpo", loss_type=loss_type, simpo_gamma=1.0)._validate_method()
    TrainArgs(method="cpo", loss_type="simpo", simpo_gamma=1.0)._validate_method()
