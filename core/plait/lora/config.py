"""LoRA settings as peft's own ``LoraConfig``: plait reads its semantics and writes its format.

plait owns only the parallel layers (``lora/layers.py``); the meaning of r, alpha, dropout, target modules
(matched by peft's ``check_target_module_exists``), target parameters (routed experts' stacked weights, adapted as
peft's ``ParamWrapper`` does: ``lora/experts.py``), the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)
and the initialisation (A kaiming-uniform, B zeros; both kaiming-uniform for ``init_lora_weights=False``)
are peft's. Options peft has that change the layer itself (DoRA, LoRA biases, per-module ranks, ...) are
refused here, by name, before any process group exists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from plait.base.config import ConfigError
from plait.base.words import setting

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig

# LoraConfig fields plait implements, and the value every other field must keep (peft's default)
_REFUSED_UNLESS_DEFAULT = (
    "use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication",
    "trainable_token_indices", "use_qalora", "loftq_config", "eva_config", "corda_config",
)


def lora_config(
    r: int, alpha: float, dropout: float = 0.0, target_modules: list[str] | str | None = None, **peft_kwargs: Any
) -> LoraConfig:
    """A peft ``LoraConfig`` from plait's flags (``target_modules`` None: the adapter's projections, filled in
    by ``plan_lora`` once the model is known). Raises ConfigError for values plait cannot train."""
    from peft import LoraConfig

    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"--lora_r={r!r} must be a positive integer (the adapter rank, e.g. 8)")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"--lora_dropout={dropout!r} must be in [0, 1)")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type="CAUSAL_LM", **peft_kwargs)
    check_supported(config)
    return config


def check_supported(config: LoraConfig) -> None:
    """Refuse peft options that plait's parallel layers do not implement, naming them."""
    from peft import LoraConfig

    default = LoraConfig()
    changed = [name for name in _REFUSED_UNLESS_DEFAULT if getattr(config, name) != getattr(default, name)]
    if config.bias != "none":
        changed.append(f"bias={config.bias!r}")
    if config.init_lora_weights not in (True, False):
        changed.append(f"init_lora_weights={config.init_lora_weights!r}")
    if changed:
        raise ConfigError(f"LoRA options {changed} are not supported by plait's parallel LoRA layers; use plain "
                          f"LoRA (r, lora_alpha, lora_dropout, target_modules, target_parameters, use_rslora, "
                          f"init_lora_weights)")
    if config.target_parameters and config.lora_dropout:
        raise ConfigError(f"{setting('lora_dropout', config.lora_dropout)} with "
                          f"{setting('target_parameters', config.target_parameters)}: a parameter's update is added "
                          f"to the weight, which has no input to drop (peft refuses it too); use "
                          f"{setting('lora_dropout', 0)}")


def scaling(config: LoraConfig) -> float:
    """peft's scaling of the low-rank update: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
