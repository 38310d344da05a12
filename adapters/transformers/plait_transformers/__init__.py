"""plait's generic adapter: plans for any decoder-only transformers causal LM, derived from what transformers
declares for it (``base_model_tp_plan``, ``base_model_pp_plan``, ``_no_split_modules``) and checked against
the model built on the meta device (derivation.py and the modules it names).

It claims no fixed architectures: the registry hands it only models no explicit adapter claims, so an
explicit adapter (plait-llama, ...) always wins and stays the way to override a derived plan. It serves every
decoder-only causal LM: data parallelism and ZeRO need no plan, pipeline cuts come from transformers' pp plan or
the module tree, and tensor parallelism from transformers' tp plan; what it cannot derive correctly is refused
with the architecture, the module and the reason when a layout needs that plan.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from plait import AdapterInfo, ConfigError, hookimpl
from plait.base.meta import causal_lm_refusal
from plait_transformers.derivation import Refusal, derive
from plait_transformers.tiny import tiny_config

MAX_TINY_PARAMETERS = 5_000_000  # a tiny config's model is built for real on every rank of a test world
# Causal-LM classes of transformers that are no model of their own: speculative-decoding draft models, whose forward
# ignores input_ids and reads the target model's input embeddings and key/value states (``inputs_embeds``,
# ``shared_kv_states``; without them it raises), which a training step on token ids does not have.
DRAFT_MODELS = {"gemma4_assistant": "Gemma 4", "gemma4_unified_assistant": "Gemma 4 unified"}


@hookimpl
def plait_adapter_info():
    return AdapterInfo(name="transformers", architectures=(), generic=True)


@hookimpl
def plait_refusal(config):
    return _not_a_causal_lm(config)


def _not_a_causal_lm(config) -> str | None:
    """Why ``config`` cannot be a decoder-only transformers causal LM (None: it can): what no plan, derived or
    written, makes plait train. A missing tp plan is not among them: data parallelism and ZeRO need no plan,
    and the pipeline cut is derived from the module tree; only a layout with tp > 1 needs one."""
    model_type = getattr(config, "model_type", None)
    if _config_class(model_type) is None:
        return f"transformers has no config class for model_type {model_type!r}"
    return _draft_refusal(model_type) or causal_lm_refusal(config)


def _draft_refusal(model_type: str | None) -> str | None:
    """Why a draft model (DRAFT_MODELS) cannot be trained on its own; None for any other ``model_type``. Asked
    before its config class is built: Gemma 4's assistant config class rejects its own defaults."""
    if model_type not in DRAFT_MODELS:
        return None
    target = DRAFT_MODELS[model_type]
    return (f"{model_type} is a speculative-decoding draft model: its forward needs the target {target} model's "
            f"input embeddings and key/value states (inputs_embeds, shared_kv_states), not token ids; plait trains "
            f"causal LMs that run on token ids")


@hookimpl
def plait_tp_plan(config):
    return _plan(derive(config).tp)


@hookimpl
def plait_sp_plan(config):
    return _plan(derive(config).sp)


@hookimpl
def plait_pipeline_plan(config):
    return _plan(derive(config).pipeline)


@hookimpl
def plait_leaf_modules(config):
    return derive(config).leaves


@hookimpl
def plait_tiny_config(architecture):
    return _tiny(architecture, plait_refusal)


def _tiny(architecture: str, refusal_of):
    """The checked tiny config of ``architecture``, unless ``refusal_of`` its default config says why not: the
    kit's (``plait_refusal``: only what this adapter serves) or ``show_derived``'s (any decoder-only causal LM)."""
    config_class = _config_class(architecture)
    refusal = (f"unknown model_type {architecture!r}" if config_class is None else
               _draft_refusal(architecture) or refusal_of(config_class()))
    if refusal:
        raise ConfigError(f"the generic adapter cannot serve {architecture!r}: {refusal}")
    try:
        config = tiny_config(config_class)
    except Exception as err:  # the class's own validation of the shrunk values: one line, not a traceback
        raise _tiny_error(architecture, config_class, "are refused by the config class", err) from err
    return checked(config)


def checked(config):
    """``config`` once a model built from it runs a forward pass: transformers' defaults for some classes, shrunk
    or not, build models that do not (a test model that cannot run one process proves nothing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.base.meta import build_meta_model

    try:
        size = sum(p.numel() for p in build_meta_model(config).parameters())
    except Exception as err:
        raise _tiny_error(config.model_type, type(config), "do not build a model", err) from err
    if size > MAX_TINY_PARAMETERS:
        raise ConfigError(f"the tiny {config.model_type} config derived from {type(config).__name__}'s defaults still "
                          f"has {size:,} parameters (a size it does not shrink); give the architecture an adapter "
                          f"with its own plait_tiny_config")
    try:
        with torch.no_grad():
            vocab = config.get_text_config().vocab_size  # a composite (Llama4) holds it in its text config
            # as plait runs every forward: without a cache (BLT's builds one from a config without num_hidden_layers)
            AutoModelForCausalLM.from_config(config)(input_ids=torch.arange(8).view(1, 8) % vocab, use_cache=False)
    except Exception as err:
        raise _tiny_error(config.model_type, type(config), "do not run one forward pass", err) from err
    return config


def _tiny_error(architecture: str, config_class: type, what: str, err: Exception) -> ConfigError:
    """One line naming the architecture and transformers' own error, for a tiny config that does not work."""
    return ConfigError(f"the tiny {architecture} config values derived from {config_class.__name__}'s defaults {what} "
                       f"({type(err).__name__}: {' '.join(str(err).split())}); give the architecture an adapter with "
                       f"its own plait_tiny_config")


def _plan(plan):
    if isinstance(plan, Refusal):
        raise ConfigError(f"the generic transformers adapter cannot derive this plan: {plan}")
    return plan


def _config_class(model_type: str | None):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def show_derived(source: str) -> str:
    """The plans derived for ``source`` (a ``model_type``, whose tiny config is used, or a config.json path or
    model directory) as the code of an explicit adapter module to start from: it loads as is and gives the
    same plans (head counts and sizes are the config's; read them from ``config`` to generalise). Refused
    plans become a hook raising the refusal; the derivation's notes are comments. A model_type this adapter
    does not serve (no tp plan declared) still gets one, as a config of it does: the starter is where its
    adapter begins. The docstring says what the conformance kit has proven of these plans, if anything."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source) if Path(source).exists() else _tiny(source, _not_a_causal_lm)
    derived = derive(config)
    plans = {"plait_tp_plan": derived.tp, "plait_sp_plan": derived.sp, "plait_pipeline_plan": derived.pipeline}
    styles = sorted({type(r).__name__ for r in getattr(derived.tp, "rules", ())})
    lines = [f'"""plait adapter for {derived.architecture}, started from the plans plait-transformers derives for '
             f'{type(config).__name__}', f"(`plait plan --show-derived {source}`). Head counts and sizes are this "
             f"config's.", "", *_proof(derived.architecture), '"""', "",
             "from plait import AdapterInfo, ConfigError, PipelinePlan, SPPlan, TPPlan, hookimpl"]
    if styles:
        lines.append(f"from plait.tp.styles import {', '.join(styles)}")
    lines += ["", "", "@hookimpl", "def plait_adapter_info():",
              f"    return AdapterInfo(name={derived.architecture + '-explicit'!r}, "
              f"architectures=({derived.architecture!r},))", "", ""]
    for hook, plan in plans.items():
        if isinstance(plan, Refusal):
            lines.append("# unproven: write this plan, then run `plait check-adapter <this module>`")
        lines += ["@hookimpl", f"def {hook}(config):"]
        if isinstance(plan, Refusal):
            lines += [f"    raise ConfigError({str(plan)!r})", "", ""]
        elif hook == "plait_tp_plan":
            lines += ["    return TPPlan((", *(f"        {rule!r}," for rule in plan.rules), "    ))", "", ""]
        else:
            lines += [f"    return {plan!r}", "", ""]
    lines += ["@hookimpl", "def plait_leaf_modules(config):", f"    return {derived.leaves!r}"]
    lines += [f"# derived: {note}" for note in derived.notes]
    return "\n".join(lines) + "\n"


# Where scripts/architecture_sweep.py writes the conformance kit's results for every architecture (a checkout's).
SWEEP_RESULTS = Path(__file__).resolve().parents[3] / "docs" / "architectures.md"
# A sweep cell's first word -> what the docstring of a starter says of that mode.
OUTCOMES = {"pass": "passed", "whole": "passed with blocks kept whole on every tp rank", "FAIL": "failed",
            "NOISE": "failed in fp32 (not rechecked in float64)", "refused": "refused", "n/a": "n/a"}


def _proof(architecture: str) -> list[str]:
    """Docstring lines saying what is proven of the generic adapter's plans for ``architecture``: the modes the
    sweep recorded in SWEEP_RESULTS as passed, failed or refused, at its transformers version, for the tiny
    config; else that nothing is. Only what the file records: a sweep that ran an explicit adapter proved that
    adapter's plans, not these."""
    import transformers

    text = SWEEP_RESULTS.read_text() if SWEEP_RESULTS.is_file() else ""
    version = re.search(r"\(transformers (\S+?),", text)
    header = next((line for line in text.splitlines() if line.startswith("| architecture | adapter |")), None)
    row = next((line for line in text.splitlines() if line.startswith(f"| {architecture} | transformers |")), None)
    if not (version and header and row):
        return textwrap.wrap(f"Unproven: docs/architectures.md records no conformance-kit run of the generic "
                             f"adapter's plans for {architecture}. Add a plait_tiny_config hook, then run "
                             f"`plait check-adapter <this module>`.", 112)
    columns = [cell.strip() for cell in header.strip().strip("|").split("|")]
    cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
    found: dict[str, list[str]] = {}
    for mode, cell in zip(columns, cells):
        if mode in ("architecture", "adapter", "tp plan"):
            continue
        found.setdefault(OUTCOMES.get(cell.split(" ")[0].rstrip(":"), "not run"), []).append(mode)
    outcomes = "; ".join(f"{outcome} {', '.join(names)}" for outcome, names in found.items())
    installed = "" if transformers.__version__ == version.group(1) else \
        f" (installed: transformers {transformers.__version__}, whose plans may differ)"
    return textwrap.wrap(f"Conformance kit on the generic adapter's plans for the tiny {architecture} config, as "
                         f"scripts/architecture_sweep.py recorded it in docs/architectures.md at transformers "
                         f"{version.group(1)}{installed}: {outcomes}. Unproven: any other config, and whatever you "
                         f"change; run `plait check-adapter <this module>`.", 112)
