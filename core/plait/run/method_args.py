"""The training methods' flags, with TRL's names (``plait train --method``): DPO's, CPO's and ORPO's (DPOConfig,
CPOConfig, ORPOConfig), distillation's and GRPO's (GRPOConfig). ``TrainArgs`` holds them with the run's own; a flag of
another method than the chosen one is refused by name (``SETTINGS``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from plait.base.config import ConfigError
from plait.base.words import no_effect


def _names(listed: str) -> list[str]:
    """The names of a comma-separated flag (empty: none)."""
    return [name.strip() for name in listed.split(",") if name.strip()]


# plait.run.methods.table.METHODS, by name (tests/test_dpo.py holds them equal)
METHODS = ("next_token", "dpo", "cpo", "orpo", "kd", "grpo")
# DPO's flags, with TRL's names (DPOConfig); they need --method dpo
DPO_SETTINGS = ("beta", "loss_type", "loss_weights", "label_smoothing", "truncation_mode", "precompute_ref_log_probs",
                "ref_model_name_or_path")
TRUNCATION_MODES = ("keep_start", "keep_end")
KD_SETTINGS = ("teacher_model_name_or_path", "kd_loss", "kd_beta", "kd_temperature", "kd_ratio")  # need --method kd
# the methods each method-specific flag takes effect with (TRL's CPOConfig and ORPOConfig share DPOConfig's names)
# GRPO's flags, with TRL's names (GRPOConfig); --beta and --loss_type are shared with DPO, their defaults TRL's per
# method (GRPO: beta 0.0, loss_type dapo; DPO: 0.1 and sigmoid)
GRPO_SETTINGS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "epsilon",
                 "epsilon_high", "scale_rewards", "num_iterations", "reward_funcs", "reward_weights",
                 "use_bias_correction_kl")
SETTINGS = {**{name: ("dpo",) for name in DPO_SETTINGS}, "beta": ("dpo", "cpo", "orpo", "grpo"),
            "loss_type": ("dpo", "cpo", "grpo"), "label_smoothing": ("dpo", "cpo"), "simpo_gamma": ("cpo",),
            "cpo_alpha": ("cpo",), **{name: ("kd",) for name in KD_SETTINGS},
            **{name: ("grpo",) for name in GRPO_SETTINGS}}
DEFAULTS = {"beta": {"grpo": 0.0}, "loss_type": {"grpo": "dapo"}}  # else beta 0.1, loss_type sigmoid
KD_LOSSES = ("fkl", "rkl", "jsd")  # plait.run.methods.kd.divergence's kinds


@dataclass
class MethodArgs:
    """The method-specific flags of ``TrainArgs`` (its base class)."""

    method: str = field(default="next_token", metadata={
        "help": f"the training method: one of {', '.join(METHODS)} (next_token: language modelling, or SFT on chat "
                "/ prompt-completion data; dpo: preference training on a .jsonl of 'prompt', 'chosen', 'rejected' "
                "rows, TRL's DPOTrainer; --block_size is its max_length; cpo, orpo: the same rows without a "
                "reference model, TRL's CPOTrainer (SimPO: --loss_type simpo --cpo_alpha 0) and ORPOTrainer; kd: "
                "distillation from --teacher_model_name_or_path on the next-token data; grpo: online RL on a .jsonl "
                "of prompts ('prompt': text or chat messages) with --reward_funcs, TRL's GRPOTrainer)"})
    beta: float | None = field(default=None, metadata={
        "help": "dpo, cpo, orpo: the preference loss's scale (TRL's beta; dpo: the strength of the pull to the "
                "reference model; default 0.1); grpo: the KL penalty's weight (default 0.0: no reference model is "
                "loaded)"})
    loss_type: str | None = field(default=None, metadata={
        "help": "grpo: one of grpo, dr_grpo, dapo (default), bnpo, as TRL's; dpo (default sigmoid): the preference "
                "loss, or several comma-separated (summed, weighted by --loss_weights), as TRL's loss_type: "
                "sigmoid, hinge, ipo, robust, apo_zero, apo_down, nca_pair, bco_pair, sppo_hard, sigmoid_norm, "
                "exo_pair, sft (the chosen completions' NLL: RPO is sigmoid,sft); cpo: one of sigmoid, hinge, ipo, "
                "simpo"})
    loss_weights: str | None = field(default=None, metadata={
        "help": "dpo: comma-separated weights, one per --loss_type (default: 1 each)"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "dpo, cpo: the probability that a preference label is wrong, in [0, 0.5) (TRL's label_smoothing; "
                "read by dpo's robust and exo_pair losses and cpo's sigmoid and simpo only, refused with the others)"})
    truncation_mode: str = field(default="keep_start", metadata={
        "help": f"dpo: how a prompt + completion longer than --block_size is cut: one of "
                f"{', '.join(TRUNCATION_MODES)} (keep_start drops rows whose prompt alone fills it, as TRL)"})
    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "dpo: read the reference model's log-probs of every row once before training, then free it"})
    simpo_gamma: float = field(default=0.5, metadata={
        "help": "cpo: the target reward margin of --loss_type simpo (TRL's simpo_gamma)"})
    cpo_alpha: float = field(default=1.0, metadata={
        "help": "cpo: the weight of the chosen completions' NLL beside the preference loss (TRL's cpo_alpha; SimPO: "
                "0)"})
    ref_model_name_or_path: str | None = field(default=None, metadata={
        "help": "dpo: the reference model's directory (same vocabulary; default: the policy as it starts)"})
    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "kd: the teacher's model directory (or plait checkpoint): the student's vocabulary, any size; laid "
                "out on the student's layout, forward-only"})
    kd_loss: str = field(default="fkl", metadata={
        "help": f"kd: the divergence per token, one of {', '.join(KD_LOSSES)}: fkl KL(teacher||student), rkl "
                "KL(student||teacher), jsd the generalized Jensen-Shannon divergence with --kd_beta (TRL's "
                "generalized_jsd_loss: beta 0 is fkl, 1 rkl)"})
    kd_beta: float = field(default=0.5, metadata={
        "help": "kd: the teacher's weight in jsd's mixture, strictly between 0 and 1 (TRL's GKD beta)"})
    kd_temperature: float = field(default=1.0, metadata={
        "help": "kd: both models' logits are divided by it before the divergence"})
    kd_ratio: float = field(default=0.5, metadata={
        "help": "kd: the loss is (1 - kd_ratio) x cross-entropy + kd_ratio x divergence (1: the divergence alone)"})
    num_generations: int = field(default=8, metadata={
        "help": "grpo: completions per prompt (a group); it divides the global batch of completions"})
    max_completion_length: int = field(default=256, metadata={
        "help": "grpo: new tokens per completion at most (prompt + completion fit in --block_size)"})
    temperature: float = field(default=1.0, metadata={
        "help": "grpo: sampling temperature of the rollouts (and of the log-probs, as TRL)"})
    top_p: float = field(default=1.0, metadata={"help": "grpo: nucleus sampling's mass"})
    top_k: int = field(default=0, metadata={"help": "grpo: sample from the k likeliest tokens (0: all)"})
    epsilon: float = field(default=0.2, metadata={"help": "grpo: the ratio's lower clip, 1 - epsilon"})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "grpo: the ratio's upper clip, 1 + epsilon_high (default: --epsilon; DAPO: 0.28)"})
    scale_rewards: str = field(default="group", metadata={
        "help": "grpo: advantages divided by the group's reward std (group), the batch's (batch) or not (none)"})
    num_iterations: int = field(default=1, metadata={
        "help": "grpo: optimizer steps on each batch of rollouts (TRL's mu)"})
    reward_funcs: str | None = field(default=None, metadata={
        "help": "grpo: comma-separated reward functions, FILE.py:FUNC or module:func, TRL's signature f(prompts, "
                "completions, **columns) -> list[float]"})
    reward_weights: str | None = field(default=None, metadata={
        "help": "grpo: comma-separated weights, one per --reward_funcs (default: 1 each)"})
    use_bias_correction_kl: bool = field(default=True, metadata={
        "help": "grpo: the KL term times the importance ratio (TRL 1.16's default: the unbiased reverse-KL gradient "
                "of DeepSeek-V3.2; the same value, another gradient even on-policy); --no_use_bias_correction_kl: "
                "the plain k3 term"})

    def dpo_loss_types(self) -> list[str]:
        return _names(self.loss_type)

    def dpo_loss_weights(self) -> tuple[float, ...] | None:
        return None if self.loss_weights is None else tuple(float(w) for w in _names(self.loss_weights))

    def __post_init__(self) -> None:
        """--beta and --loss_type left unset take the method's default (TRL's: GRPO 0.0 and dapo, DPO 0.1 and
        sigmoid) where the method takes them; elsewhere they stay unset, so that giving one is seen."""
        for name, by_method in DEFAULTS.items():
            if getattr(self, name) is None and self.method in SETTINGS[name]:
                setattr(self, name, by_method.get(self.method, {"beta": 0.1, "loss_type": "sigmoid"}[name]))

    def _validate_method(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--method {self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        defaults = {f.name: f.default for f in fields(self)}
        for methods in dict.fromkeys(SETTINGS.values()):
            given = [f"--{name}" for name, where in SETTINGS.items() if where == methods
                     and getattr(self, name) != defaults[name]]
            if given and self.method not in methods:
                wanted = " or ".join(f"--method {m}" for m in methods)
                raise ConfigError(no_effect(given, f" without {wanted} (--method {self.method})", f", or use {wanted}"))
        if self.method == "kd":
            self._validate_kd(defaults)
        if self.method == "grpo":
            from plait.run.methods.grpo_args import check_grpo  # TRL's rules, one line each

            check_grpo(self)
        if self.method in ("cpo", "orpo"):
            from plait.run.methods.reference_free import CPOLoss, ORPOLoss  # their checks, one line each

            CPOLoss(self.beta, self.loss_type, self.label_smoothing, self.simpo_gamma, self.cpo_alpha) \
                if self.method == "cpo" else ORPOLoss(self.beta)
            if self.method == "cpo" and self.loss_type != "simpo" and self.simpo_gamma != defaults["simpo_gamma"]:
                raise ConfigError(no_effect(["--simpo_gamma"], f" with --loss_type {self.loss_type} (it is the target "
                                            f"margin of --loss_type simpo)", ", or use --loss_type simpo"))
        if self.method not in ("dpo", "cpo", "orpo"):
            return
        if self.dataset_name:
            raise ConfigError(f"--method {self.method} does not take --dataset_name yet (preference pairs come from a "
                              f".jsonl --train_file); drop it")
        if self.method != "dpo":
            return
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(f"--truncation_mode {self.truncation_mode!r} is unknown; choose one of "
                              f"{', '.join(TRUNCATION_MODES)}")
        try:
            weights = self.dpo_loss_weights()
        except ValueError:
            raise ConfigError(f"--loss_weights {self.loss_weights!r}: give comma-separated numbers, one per "
                              f"--loss_type") from None
        from plait.run.methods.preference_loss import PreferenceLoss  # its checks: TRL's rules, one line each

        PreferenceLoss(self.beta, tuple(self.dpo_loss_types()), weights, self.label_smoothing)

    def _validate_kd(self, defaults: dict) -> None:
        if not self.teacher_model_name_or_path:
            raise ConfigError("--method kd needs --teacher_model_name_or_path: the teacher's model directory")
        if self.kd_loss not in KD_LOSSES:
            raise ConfigError(f"--kd_loss {self.kd_loss!r} is unknown; choose one of {', '.join(KD_LOSSES)}")
        if self.kd_loss != "jsd" and self.kd_beta != defaults["kd_beta"]:
            raise ConfigError(f"--kd_beta has no effect with --kd_loss {self.kd_loss} (it weighs jsd's mixture); drop "
                              f"it, or use --kd_loss jsd")
        if not 0.0 < self.kd_beta < 1.0:
            raise ConfigError(f"--kd_beta={self.kd_beta:g} must lie strictly between 0 and 1 (0 is --kd_loss fkl, 1 is "
                              f"--kd_loss rkl)")
        if not self.kd_temperature > 0.0:
            raise ConfigError(f"--kd_temperature={self.kd_temperature:g} must be positive")
        if not 0.0 <= self.kd_ratio <= 1.0:
            raise ConfigError(f"--kd_ratio={self.kd_ratio:g} must lie in [0, 1] (the divergence's weight against the "
                              f"cross-entropy)")
