"""The adapter contract: every hook an architecture plugin can implement.

An adapter is a module (or object) with functions decorated by ``@plait.hookimpl``, registered through the
entry-point group ``plait.adapters``. Implementations may accept fewer arguments than the spec (pluggy
passes only the names they declare), so hooks can grow arguments without breaking plugins.

The core calls each hook on the one adapter chosen for a model's architecture, not on all adapters, so an
implementation never needs to check whether the config is "its" model.

Required hooks: ``plait_adapter_info``, ``plait_tp_plan`` and ``plait_leaf_modules``. ``plait_sp_plan`` is
required when the adapter declares the ``sp`` capability. The others are optional; the conformance kit
(``plait check-adapter``) needs ``plait_tiny_config``.

Template: each docstring says what the hook returns, when the core calls it, and its parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from plait.plugin.declarations import AdapterInfo, PipelinePlan
    from plait.tp.plans import SPPlan, TPPlan

hookspec = pluggy.HookspecMarker("plait")

# --------------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------------


@hookspec
def plait_adapter_info() -> "AdapterInfo":
    """Return the adapter's name, the architectures it claims and its capabilities.

    Called once when the adapter loads. ``architectures`` holds transformers ``model_type`` values
    (``"llama"``) and/or model class names (``"LlamaForCausalLM"``). Two adapters claiming one architecture
    is an error that names both. Capabilities (tp, sp, pp, vpp, tied_embeddings) the adapter has not
    proven are refused for its models before any weight moves.
    """


@hookspec
def plait_refusal(config: "PretrainedConfig") -> str | None:
    """Generic adapters (``AdapterInfo.generic``) only: return None when the adapter can serve the model of
    ``config``, else one line saying why not (the architecture, what is missing, the fix).

    Called by the registry for an architecture that no explicit adapter claims, before any plan is asked for.

    :param config: the transformers config of the model to parallelize.
    """


# --------------------------------------------------------------------------------------------------
# Tensor and sequence parallelism
# --------------------------------------------------------------------------------------------------


@hookspec
def plait_tp_plan(config: "PretrainedConfig") -> "TPPlan":
    """Return how the model's modules split over the tensor-parallel group.

    Called by ``parallelize`` and ``plait plan``. Use ``Attention`` for attention blocks (head counts from
    ``config``), ``Column`` / ``Row`` for other linears, ``VocabEmbedding`` / ``VocabHead`` for the input
    embedding and LM head. Modules no rule matches stay replicated.

    :param config: the transformers config of the model being parallelized.
    """


@hookspec
def plait_sp_plan(config: "PretrainedConfig") -> "SPPlan":
    """Return the sequence-parallel region: where it begins and ends, and its norms.

    Called by ``parallelize`` when tp > 1 and sequence parallelism is on.

    :param config: the transformers config of the model being parallelized.
    """


# --------------------------------------------------------------------------------------------------
# Pipeline parallelism and activation checkpointing
# --------------------------------------------------------------------------------------------------


@hookspec
def plait_pipeline_plan(config: "PretrainedConfig") -> "PipelinePlan | None":
    """Return which modules go to the first stage, which container holds the repeated layers, which go to
    the last stage, and what later stages must neutralise. Return None (or omit the hook) to let plait
    derive stages from the leaf modules (the ModuleList holding them is the repeated part).

    :param config: the transformers config of the model being parallelized.
    """


@hookspec
def plait_leaf_modules(config: "PretrainedConfig") -> "list[str]":
    """Return module name patterns of the units never split across pipeline stages and wrapped whole by
    activation checkpointing (the decoder layers, e.g. ``["model.layers.*"]``).

    :param config: the transformers config of the model being parallelized.
    """


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


@hookspec
def plait_init_weight(name: str, tensor: "torch.Tensor", config: "PretrainedConfig", generator: "torch.Generator") -> bool | None:
    """Initialise the full logical tensor of parameter ``name`` in place, drawing only from ``generator``
    (seeded per parameter by the core so the result does not depend on the layout). Return True when
    handled; None falls back to plait's default (normal(0, config.initializer_range) for matrices, ones for
    norm weights, zeros for biases).

    :param name: the parameter's dotted name in the unparallelized model.
    :param tensor: a CPU tensor of the parameter's full shape and dtype, to fill.
    :param config: the transformers config of the model.
    :param generator: the torch.Generator to draw from.
    """


# --------------------------------------------------------------------------------------------------
# Testing
# --------------------------------------------------------------------------------------------------


@hookspec
def plait_tiny_config(architecture: str | None) -> "PretrainedConfig":
    """Return a small transformers config of this architecture for conformance tests (a few layers, hidden
    32-64, vocab ~60-130).

    ``architecture``: the ``model_type`` asked for, for a generic adapter (``plait check-adapter
    transformers:qwen3``); None for an adapter of fixed architectures, which may omit the parameter.

    Called by the conformance kit (``plait check-adapter``, ``plait.testing.assert_conformance``), which
    builds a model from it and trains it for a few steps under every parallel mode against one process.
    Choose sizes that exercise the adapter's paths: 4 layers (pp=2 with 2 virtual stages per rank needs
    one per stage), an attention head count divisible by 4, fewer kv heads than heads where the
    architecture has them (kv-head replication at tp=4), a vocabulary tp does not divide (padding), and
    dropout 0 (parity needs a deterministic forward).
    """
