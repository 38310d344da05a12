"""LoRA settings as peft's own ``LoraConfig``: plait reads its semantics and writes its format.

plait owns only the parallel layers (``lora/layers.py``); the meaning of r, alpha, dropout, target modules
(matched by peft's ``check_target_module_exists``), target parameters (routed experts' stacked weights, adapted as
peft's ``ParamWrapper`` does: ``lora/experts.py``), the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)
and the initialisation (A kaiming-uniform, B zeros; both kaiming-uniform for ``init_lora_weights=False``)
are peft's. Options peft has that change the layer itself (DoRA, LoRA biases, per-module ranks, ...) are
refused here, by name, before any process group exists.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from plait.base.config import ConfigError
from plait.base.words import setting

if TYPE_CHECKING:  # peft is imported only where LoRA is used: it costs every process seconds
    from peft import LoraConfig

# LoraConfig fields plait implements, and the value every other field must keep (peft's default)
# The LoraConfig fields plait's parallel LoRA layers honour, or that only describe the config: any other one set
# otherwise than its default changes the layer in a way they do not implement, and is refused by name. An allow-list,
# not a list of the refused: peft's new options (aLoRA's alora_invocation_tokens, arrow_config, use_bdlora, ...)
# were accepted and silently trained as plain LoRA.
_SUPPORTED = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
              "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "fan_in_fan_out",
              "bias", "use_rslora", "init_lora_weights", "layers_to_transform", "layers_pattern", "target_parameters",
              "runtime_config", "megatron_core"}


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
    changed = [f.name for f in dataclasses.fields(config)
               if f.name not in _SUPPORTED and getattr(config, f.name) != getattr(default, f.name)]
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
