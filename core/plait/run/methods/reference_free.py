"""Reference-free preference training on any layout: TRL 1.16's CPOTrainer (``plait train --method cpo``; SimPO is
``--loss_type simpo --cpo_alpha 0``, TRL's way of naming it) and ORPOTrainer (``--method orpo``).

Both score a pair by the policy alone, so no second model is laid out: DPO's machinery (``DPO``: each pair's chosen
and rejected rows side by side in one forward, per-row log-probs read on any layout, per-pair losses summed and
divided by the global batch's pair count) runs with zeros for the reference. What differs is theirs:

- The data: both trainers tokenize rows TRL's older way (``tokenize_legacy``): the prompt and prompt+completion as
  text without special tokens, the completion being prompt+completion's ids after the prompt's (one fewer where the
  prompt's last token merges across the boundary), the tokenizer's BOS put before the prompt and its EOS after each
  completion where missing; a completion longer than ``--block_size`` allows after the prompt is cut. Conversational
  rows are rendered with the chat template as text first (TRL's ``maybe_apply_chat_template``).
- The losses (``CPOLoss``, ``ORPOLoss``), with TRL's metrics. Log-probs are per-token means for CPO's ``ipo`` and
  ``simpo`` and always for ORPO. The chosen completions' negative log-likelihood (CPO's ``cpo_alpha`` x it, ORPO's
  whole) is a mean over the global batch's chosen tokens, as DPO's ``sft`` term: on one process, TRL's per-batch mean.
  TRL's ``logits/chosen`` and ``logits/rejected`` (a mean over every vocabulary entry of padded rows) are not logged.

tests/test_reference_free.py holds both to TRL's trainers on one process and to one process on every layout.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plait.base.config import ConfigError
from plait.base.words import no_effect
from plait.data.paths import tokenizer_dir
from plait.data.tokenizer import load_tokenizer
from plait.run.methods.dpo import DPO, check_packing, routed
from plait.run.methods.preference_data import Pair, check_row, extract_prompt, is_conversational, real_tokens
from plait.run.methods.preference_loss import METRICS, PairLogps
from plait.run.runtime import reports_data
from plait.tp.logprobs import Logits
from plait.tp.loss import IGNORE_INDEX

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def chat_texts(tokenizer: Any, example: dict[str, Any]) -> tuple[str, str, str]:
    """A conversational row as text (TRL's ``apply_chat_template`` for an explicit prompt): the prompt rendered with
    the generation prompt (or continuing its last assistant message), each completion what the template renders for
    prompt + completion after the prompt's shared start."""
    last = example["prompt"][-1]["role"]
    if last not in ("user", "tool", "assistant"):
        raise ConfigError(f"the prompt's last message has role {last!r}; it must be user, tool or assistant")
    prompt = tokenizer.apply_chat_template(example["prompt"], tokenize=False, add_generation_prompt=last != "assistant",
                                           continue_final_message=last == "assistant")
    whole = [tokenizer.apply_chat_template(example["prompt"] + example[key], tokenize=False)
             for key in ("chosen", "rejected")]
    for text in whole:
        prompt = prompt[:next((i for i, (a, b) in enumerate(zip(prompt, text)) if a != b), min(len(prompt), len(text)))]
    return prompt, whole[0][len(prompt):], whole[1][len(prompt):]


def tokenize_legacy(tokenizer: Any, prompt: str, chosen: str, rejected: str, where: str) -> Pair:
    """TRL's CPO/ORPO ``tokenize_row`` (before truncation): (prompt ids, chosen ids, rejected ids)."""
    prompts, answers = [], []
    for answer in (chosen, rejected):
        whole = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
        alone = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        start = len(alone) - (alone != whole[:len(alone)])  # the prompt's last token merged into the answer's first
        prompts.append(whole[:start])
        answers.append(whole[start:])
    if prompts[0] != prompts[1]:
        raise ConfigError(f"{where}: the prompt's last token merges differently with the chosen and the rejected "
                          f"completion ({prompts[0][-1:]} vs {prompts[1][-1:]}); start both completions with a space "
                          f"or a new line")
    prompt_ids = prompts[0]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is not None and (not prompt_ids or prompt_ids[0] != bos):
        prompt_ids = [bos] + prompt_ids
    answers = [ids if ids and ids[-1] == eos else ids + [eos] for ids in answers]
    return Pair(prompt_ids, answers[0], answers[1])


def read_legacy_pairs(path: Path, tokenizer: Any, max_length: int) -> list[Pair]:
    """Every row of a .jsonl preference file, tokenized as TRL's CPO and ORPO trainers do; a row whose prompt alone
    fills ``max_length`` is dropped (TRL would keep it with an empty completion: nothing to score), said on stderr."""
    if path.suffix != ".jsonl":
        raise ConfigError(f"--train_file {path}: preference data is read from .jsonl files (one row per line, "
                          f"'prompt', 'chosen' and 'rejected'); convert it, e.g. with datasets' to_json")
    pairs, dropped = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
            raise ConfigError(f"{where}: a preference row is a JSON object with 'chosen' and 'rejected' (and "
                              f"'prompt', or a shared start of the two)")
        check_row(row, where)  # texts, or chat messages, alike
        row = row if "prompt" in row else extract_prompt(row)
        if is_conversational(row):
            if getattr(tokenizer, "chat_template", None) is None:
                raise ConfigError(f"{where}: conversational preference rows need a tokenizer with a chat template")
            texts = chat_texts(tokenizer, row)
        else:
            texts = (row["prompt"], row["chosen"], row["rejected"])
        pair = tokenize_legacy(tokenizer, *texts, where)
        if pair.chosen == pair.rejected:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' are the same completion; a preference pair needs "
                              f"two different ones (drop the row)")
        (pairs if len(pair.prompt) < max_length else dropped).append(pair if len(pair.prompt) < max_length else number)
    if dropped and reports_data():  # one note per node, not one per rank
        print(f"note: dropped {len(dropped)} preference row(s) of {path} whose prompt alone fills --block_size "
              f"{max_length} (lines {', '.join(map(str, dropped[:5]))}{' ...' if len(dropped) > 5 else ''}); raise "
              f"--block_size to keep them", file=sys.stderr)
    if not pairs:
        raise ConfigError(f"--train_file {path}: no preference row to train on (every prompt fills --block_size "
                          f"{max_length}, or the file is empty)")
    return pairs


@dataclass(frozen=True)
class CPOLoss:
    """TRL's CPO loss: ``loss_type`` sigmoid, hinge, ipo or simpo (``simpo_gamma`` its target margin) on the policy's
    log-probs (per-token means for ipo and simpo), ``label_smoothing``, plus ``cpo_alpha`` x the chosen NLL."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ConfigError(f"--loss_type {self.loss_type} is not one of --method cpo's: {', '.join(CPO_LOSS_TYPES)} "
                              f"(SimPO: --loss_type simpo --cpo_alpha 0)")
        if self.beta <= 0:
            raise ConfigError(f"--beta={self.beta} must be positive")
        # TRL's CPO reads label_smoothing in sigmoid and simpo (cDPO's conservative loss) and ignores it in hinge and
        # ipo (it warns); as the probability that a preference label is flipped it lies in [0, 0.5), the range TRL
        # gives DPO's robust loss: from 0.5 on the labels would teach no preference, or the reverse
        if self.label_smoothing and self.loss_type in ("hinge", "ipo"):
            raise ConfigError(no_effect(["--label_smoothing"], f" with --method cpo --loss_type {self.loss_type} "
                                        f"(TRL's CPO reads it in the sigmoid and simpo losses only)",
                                        ", or use --loss_type sigmoid or simpo"))
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing={self.label_smoothing} with the {self.loss_type} loss must lie in "
                              f"[0, 0.5) (the probability that a preference label is flipped)")

    metrics = (*METRICS, "nll_loss")

    @property
    def sft_weight(self) -> float:
        return self.cpo_alpha

    def logps(self, p: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loss_type in ("ipo", "simpo"):
            return p.chosen / p.chosen_tokens, p.rejected / p.rejected_tokens
        return p.chosen, p.rejected

    def per_pair(self, p: PairLogps) -> torch.Tensor:
        chosen, rejected = self.logps(p)
        logits = chosen - rejected - (self.simpo_gamma / self.beta if self.loss_type == "simpo" else 0.0)
        if self.loss_type == "hinge":
            return torch.relu(1 - self.beta * logits)
        if self.loss_type == "ipo":
            return (logits - 1 / (2 * self.beta)) ** 2
        eps = self.label_smoothing
        return -F.logsigmoid(self.beta * logits) * (1 - eps) - F.logsigmoid(-self.beta * logits) * eps

    def metric_sums(self, p: PairLogps) -> dict[str, torch.Tensor]:
        chosen, rejected = self.logps(p)
        return {**_reward_sums(self.beta, chosen, rejected), "nll_loss": p.nll_chosen.sum()}

    def metric_means(self, sums: dict[str, float], pairs: int, chosen_tokens: int) -> dict[str, float]:
        nll = -sums["nll_loss"] / chosen_tokens if self.cpo_alpha else 0.0  # TRL: 0 without the term
        return {**{name: sums[name] / pairs for name in METRICS}, "nll_loss": nll}


@dataclass(frozen=True)
class ORPOLoss:
    """TRL's ORPO loss: the chosen NLL minus ``beta`` x log sigmoid of the log odds ratio of the per-token mean
    log-probs, log(p_c / (1 - p_c)) - log(p_r / (1 - p_r))."""

    beta: float = 0.1
    metrics = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
    sft_weight = 1.0

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"--beta={self.beta} must be positive")

    def log_odds(self, p: PairLogps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen, rejected = p.chosen / p.chosen_tokens, p.rejected / p.rejected_tokens
        return chosen, rejected, (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))

    def per_pair(self, p: PairLogps) -> torch.Tensor:
        return -self.beta * F.logsigmoid(self.log_odds(p)[2])

    def metric_sums(self, p: PairLogps) -> dict[str, torch.Tensor]:
        chosen, rejected, odds = self.log_odds(p)
        return {**_reward_sums(self.beta, chosen, rejected), "nll_loss": p.nll_chosen.sum(),
                "log_odds_ratio": F.logsigmoid(odds).sum(), "log_odds_chosen": odds.sum()}

    def metric_means(self, sums: dict[str, float], pairs: int, chosen_tokens: int) -> dict[str, float]:
        means = {name: value / pairs for name, value in sums.items()}
        return {**means, "nll_loss": -sums["nll_loss"] / chosen_tokens}


def _reward_sums(beta: float, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    rewards = (beta * chosen, beta * rejected)
    return {"rewards/chosen": rewards[0].sum(), "rewards/rejected": rewards[1].sum(),
            "rewards/accuracies": (rewards[0] > rewards[1]).float().sum(),
            "rewards/margins": (rewards[0] - rewards[1]).sum(), "logps/chosen": chosen.sum(),
            "logps/rejected": rejected.sum()}


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (TRL's branch at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class CPO(DPO):
    """DPO's machinery without a reference: the policy's own log-probs, TRL's CPO loss."""

    @classmethod
    def load_data(cls, args: Any, model_config: Any, plan: Any) -> tuple[list[Pair], list[Pair] | None, Any]:
        if not args.train_file:
            raise ConfigError(f"--method {args.method} needs --train_file: a .jsonl of preference rows ('prompt', "
                              f"'chosen', 'rejected')")
        folder = tokenizer_dir(args.tokenizer_name, args.model_name_or_path)
        if folder is None:
            raise ConfigError(f"--method {args.method} needs a tokenizer: give --model_name_or_path with one, or "
                              f"--tokenizer_name")
        args.refuse_unread(("train_on_prompt", "overlong"), f"--method {args.method} trains on each pair's "
                           f"completions and cuts pairs by its own rules, as TRL's trainer does")
        check_packing(args, model_config)
        tokenizer = load_tokenizer(folder, model_config.vocab_size)
        read = lambda path: read_legacy_pairs(Path(path), tokenizer, args.block_size)  # noqa: E731
        return read(args.train_file), read(args.validation_file) if args.validation_file else None, tokenizer

    @classmethod
    def loss(cls, args: Any) -> CPOLoss | ORPOLoss:
        return CPOLoss(args.beta, args.loss_type, args.label_smoothing, args.simpo_gamma, args.cpo_alpha)

    @classmethod
    def create(cls, trainer: Any) -> "CPO":
        args, tokenizer = trainer.args, trainer.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(trainer.blocks, cls.loss(args), None, pad_id, args.block_size, "keep_start",
                   args.per_device_train_batch_size, False, trainer.device, trainer.val_blocks, trainer.pmodel.mesh,
                   routed(trainer.pmodel), args.packing)

    @classmethod
    def second_model(cls, args: Any, model: Any, dtype: torch.dtype) -> None:
        return None  # reference-free


class ORPO(CPO):
    """DPO's machinery without a reference: TRL's ORPO loss, whose NLL term is over the chosen row's every token,
    prompt included. The model is given labels on every token of a row, its prompt's marked (their ids + ``PROMPT``)
    so that ``read_logps`` tells the completion's from the whole row's on any layout (under cp each rank holds a
    slice of the positions, under pp the last stage only the labels)."""

    PROMPT = 1 << 40  # added to a prompt token's label: no vocabulary reaches it

    @classmethod
    def loss(cls, args: Any) -> ORPOLoss:
        return ORPOLoss(args.beta)

    def model_labels(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        prompt = (labels == IGNORE_INDEX) & real_tokens(labels).bool()
        return torch.where(prompt, ids + self.PROMPT, labels)

    def read_logps(self, logits: Logits, sums: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        marked = logits.labels >= self.PROMPT
        completion = replace(logits, labels=torch.where(marked, IGNORE_INDEX, logits.labels))
        whole = replace(logits, labels=torch.where(marked, logits.labels - self.PROMPT, logits.labels))
        sums = sums or logits.sequence_sum
        return sums(completion.label_logps()), sums(whole.label_logps())
