"""GRPO's advantages and loss, with TRL 1.16's definitions (GRPOTrainer), written so that any split of the global
batch over ranks and micro-steps gives one process's loss.

Advantages: each completion's reward (the weighted sum of the reward functions', NaN-skipping as TRL's nansum) minus
its group's mean (the ``num_generations`` completions of one prompt), divided by the group's standard deviation
(``scale_rewards="group"``), the whole batch's (``"batch"``) or not at all (``"none"``), plus 1e-4; a completion no
function scored has none: it is left out of those means and deviations, its advantage 0 (TRL's unscorable one).

Loss, per completion token t (importance sampling per token, TRL's default): with r = exp(logp - old_logp) and A the
completion's advantage, ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``, plus ``beta`` times the k3 estimate
of KL(policy || reference), ``exp(ref - logp) - (ref - logp) - 1``, times r where ``use_bias_correction_kl`` (TRL
1.16's default: r is 1 on-policy, but its gradient makes the KL's the unbiased reverse-KL gradient). Every loss type
is a weighted sum of these terms, the weight fixed by the global batch before the step, so each rank's share is the
sum over its own tokens:

- ``grpo``: each completion's token mean, averaged over the completions: weight 1 / (its tokens x completions);
- ``dr_grpo``: 1 / (completions x ``max_completion_length``);
- ``dapo``: 1 / (completion tokens of the global batch);
- ``bnpo``: as TRL, a token mean over each per-device batch, averaged over the per-device batches of the step
  (ranks x accumulation): weight 1 / (tokens of its per-device batch x their count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")


def advantages(rewards: torch.Tensor, weights: torch.Tensor, generations: int, scale: str) -> torch.Tensor:
    """Each completion's advantage [completions] from ``rewards`` [completions, functions] (NaN: a function with no
    reward for it) weighted by ``weights`` [functions]; the completions of a prompt are ``generations`` in a row. A
    completion no function scored (NaN from every one) is TRL's unscorable one: left out of its group's mean and
    standard deviation (nansum would make it a 0 in them), its advantage 0."""
    total = rewarded_sum(rewards, weights)
    grouped = total.view(-1, generations)
    mean = grouped.nanmean(dim=1).repeat_interleave(generations)
    if scale == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(generations)
    elif scale == "batch":
        std = nanstd(total, dim=0).expand_as(total)
    else:
        std = None
    found = total - mean if std is None else (total - mean) / (std + 1e-4)
    return torch.nan_to_num(found, nan=0.0)


def rewarded_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's weighted sum of its rewards [completions], NaN-skipping (TRL's nansum), NaN where no function
    scored it (TRL's unscorable completion, out of the baseline and of the logged reward)."""
    total = (rewards * weights.to(rewards.dtype)).nansum(dim=1)
    return total.masked_fill(rewards.isnan().all(dim=1), float("nan"))


def logged_rewards(rewards: torch.Tensor, weights: torch.Tensor, names: Sequence[str], generations: int,
                   scale: str) -> dict[str, float]:
    """The reward metrics as TRL 1.16 logs them (grpo_trainer.py), unscorable completions left out: ``reward`` and
    ``reward_std``, the mean and standard deviation over the whole batch's weighted sums (``rewarded_sum``; not the
    groups' deviations, which scale the advantages); each function's ``rewards/<name>/mean`` and ``/std``; and
    ``frac_reward_zero_std``, the share of completions whose scaling deviation (their group's, the batch's under
    ``scale`` "batch") is zero: groups that teach nothing."""
    total = rewarded_sum(rewards, weights)
    if scale == "batch":
        spread = nanstd(total, dim=0).expand_as(total)
    else:
        spread = nanstd(total.view(-1, generations), dim=1).repeat_interleave(generations)
    found = {"reward": total.nanmean().item(), "reward_std": nanstd(total, dim=0).item(),
             "frac_reward_zero_std": torch.isclose(spread, torch.zeros_like(spread)).float().mean().item()}
    for j, name in enumerate(names):
        found[f"rewards/{name}/mean"] = rewards[:, j].nanmean().item()
        found[f"rewards/{name}/std"] = nanstd(rewards[:, j], dim=0).item()
    return found


def nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs, as TRL's ``nanstd``."""
    mean = values.nanmean(dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim)
    return ((values - mean) ** 2).nansum(dim=dim).div(count - 1).sqrt()


def token_weights(mask: torch.Tensor, loss_type: str, max_completion_length: int,
                  batches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weight of each completion token's term [completions, tokens] for the global batch's completion ``mask``;
    ``batches``: the rows of each per-device batch of the step (every rank's micro-batches: bnpo's groups)."""
    mask = mask.to(torch.float64)
    completions = mask.shape[0]
    if loss_type == "grpo":
        return mask / (mask.sum(dim=1, keepdim=True).clamp(min=1.0) * completions)
    if loss_type == "dr_grpo":
        return mask / (completions * max_completion_length)
    if loss_type == "dapo":
        return mask / mask.sum().clamp(min=1.0)
    weights = torch.zeros_like(mask)  # bnpo
    for rows in batches:
        weights[rows] = mask[rows] / (mask[rows].sum().clamp(min=1.0) * len(batches))
    return weights


def kl_k3(ref: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(policy || reference) per token, as TRL's: exp(ref - logp) - (ref - logp) - 1."""
    return torch.exp(ref - logps) - (ref - logps) - 1


def token_terms(logps: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None, advantage: torch.Tensor,
                epsilon: float, epsilon_high: float, beta: float, bias_correction: bool = True) -> torch.Tensor:
    """GRPO's term of each token [rows, tokens] from the policy's log-probs (with gradient), the old policy's (None:
    the policy's own, detached: one iteration per generation), the reference's (None where ``beta`` is 0) and each
    row's advantage [rows]; ``bias_correction``: the KL term times the ratio (TRL's use_bias_correction_kl)."""
    ratio = torch.exp(logps - (logps.detach() if old is None else old))
    advantage = advantage[:, None].to(logps.dtype)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    terms = -torch.min(ratio * advantage, clipped * advantage)
    if beta != 0.0:
        kl = kl_k3(ref, logps)
        terms = terms + beta * (kl * ratio if bias_correction else kl)
    return terms
