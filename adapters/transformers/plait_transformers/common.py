"""What every part of the generic adapter's derivation shares: the child names transformers' models give an
attention block's projections, its style names, the one-line Refusal, and small readers of a model built on
the meta device (its decoder-layer list, a module's own parameters, a layer path with its index folded).
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers.pytorch_utils import Conv1D

from plait import ConfigError
from plait.base.meta import language_model_name, takes_images
from plait.base.patterns import matches
from plait.tp.styles import WholeSequence


# Child names of an attention block's projections, as transformers' models spell them.
Q, K, V = ("q_proj", "query", "q", "Wq"), ("k_proj", "key", "k", "Wk"), ("v_proj", "value", "v", "Wv")  # Wq: CTRL


O = ("o_proj", "dense", "out_proj", "o", "c_proj", "Wo")  # Wo: ModernBERT


QKV = ("qkv_proj", "query_key_value", "qkv", "Wqkv", "c_attn")  # fused q, k and v


# Attention-module attributes that hold a head count read from the config at init: per rank under tp.
LOCAL_ATTRS = {"num_heads": "q_heads", "num_attention_heads": "q_heads", "num_key_value_heads": "kv_heads",
               "num_kv_heads": "kv_heads", "num_key_value_groups": "kv_groups", "n_heads": "q_heads"}  # n_heads: MPT


# Forward arguments of an attention block computing its scores itself that add a bias per head to them, laid out
# by head on dim 0 (ALiBi: Bloom's ``alibi`` [batch * heads, 1, S], MPT's ``position_bias`` [heads, 1, S]).
HEAD_BIASES = ("alibi", "position_bias")


def head_biases(block: nn.Module) -> tuple[str, ...]:
    """The arguments of ``block``'s forward that carry a per-head bias (``HEAD_BIASES``)."""
    return tuple(a for a in inspect.signature(type(block).forward).parameters if a in HEAD_BIASES)


# Head counts an attention forward must not read from the (shared, unsplit) config.
CONFIG_READS = {"config.num_attention_heads": "q_heads", "config.num_key_value_heads": "kv_heads"}


LINEAR_STYLES = ("colwise", "rowwise")


# transformers' styles that gather a column-parallel output / split a row-parallel input again because an op
# over the full width sits between them (a fused projection's split, a norm over all heads): plait splits for
# real where it knows that op (FusedColumn, fused qkv layouts, SplitNorm) and refuses otherwise.
GATHERED = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}


# transformers' marker on the owner of bare parameters (attention sinks) that their own entries shard
LOCAL_PARAMS = "local_params"


MOE_STYLES = ("moe_tp_experts",)  # transformers' fused experts module (gate_up_proj [E, 2I, H], down_proj)


LM_HEAD_STYLES = ("colwise_gather_output", "colwise_rep", "colwise")  # what transformers gives the LM head


class Refusal(ConfigError):
    """A plan the generic adapter cannot derive correctly; the message names architecture, module, reason."""


def refuse(arch: str, module: str, missing: str) -> Refusal:
    return Refusal(f"{arch}: {module}: {missing}")


NO_LAYERS = ("no decoder layer list found (pp plan, _no_split_modules, or a ModuleList of num_hidden_layers blocks "
             "of one class)")


def layer_container(model: nn.Module) -> str | None:
    """The ModuleList of decoder layers: the pp plan's list, else the one holding ``_no_split_modules``, else
    (neither declared: BioGPT, CTRL, GIT) the repeated block list of the module tree (``_repeated_blocks``)."""
    for name in (model.pp_plan or {}):
        if isinstance(get_module(model, name), nn.ModuleList):
            return name
    decoder_classes = set(getattr(model, "_no_split_modules", None) or ())
    lists = [name for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and any(type(c).__name__ in decoder_classes for c in module)]
    # an image-text model lists its vision tower's blocks too, sometimes first (Qwen3-VL, BLIP-2, LFM2-VL): the
    # decoder layers are those of its language model (transformers' get_decoder)
    language = _language_model(model)
    return next((n for n in lists if language is None or n.startswith(language)), None) or _repeated_blocks(model)


def _language_model(model: nn.Module) -> str | None:
    """The name (with a trailing dot) of an image-text-to-text model's language model, or None for a causal LM."""
    if not takes_images(model.config) or not hasattr(model, "get_decoder"):
        return None
    try:
        name = language_model_name(model)
    except (NotImplementedError, AttributeError):
        return None
    return f"{name}." if name else None


def _repeated_blocks(model: nn.Module) -> str | None:
    """The ModuleList of ``num_hidden_layers`` blocks of one class with parameters, the shallowest where there are
    several (GIT's text layers, not its vision tower's, nested deeper): the decoder layers of a model that declares
    neither a pp plan nor ``_no_split_modules``. None where no list fits."""
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    found = [name for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) == count and len({type(c) for c in module}) == 1
             and own_params_deep(module)]
    return min(found, key=lambda name: name.count("."), default=None)


def get_module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def own_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def layer_pattern(name: str, layers: str) -> str:
    """``model.layers.3.mlp.fc1`` -> ``model.layers.*.mlp.fc1``."""
    if name.startswith(layers + "."):
        rest = name[len(layers) + 1:].partition(".")[2]
        return f"{layers}.*" + (f".{rest}" if rest else "")
    return name


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def is_attention(block: nn.Module) -> bool:
    """An attention module: reshaped by heads, so splitting it needs an Attention rule, not Column / Row."""
    name = type(block).__name__
    return "Attention" in name or "Attn" in name or any(hasattr(block, a) for a in ("head_dim", "head_size"))


def out_features(module: nn.Module) -> int:
    return module.weight.shape[1] if isinstance(module, Conv1D) else module.out_features


def own_params_deep(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def holds(module: nn.Module, target: nn.Module | None) -> bool:
    return target is not None and any(m is target for m in module.modules())


def is_softmax_attention(block: nn.Module) -> bool:
    """Whether a block calls transformers' attention functions (softmax attention over heads)."""
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(type(block).forward)


def whole_sequence(arch: str, pattern: str, block: nn.Module) -> WholeSequence:
    """A block kept whole on every rank and run on the whole sequence under SP (a recurrent or state-space mixer):
    WholeSequence gathers its forward's first argument, the hidden states."""
    first = next(iter(inspect.signature(block.forward).parameters), None)
    if first is None:
        raise refuse(arch, pattern, f"{type(block).__name__} is kept whole and must see the whole sequence under SP, but "
                                    f"its forward takes no hidden states")
    return WholeSequence(pattern, argument=first)


def is_covered(name: str, patterns: list[str]) -> bool:
    """Whether module ``name`` or a block holding it matches one of the tp plan's ``patterns`` (per-layer rules
    name layers literally, so compare with concrete names, not folded patterns)."""
    parts = name.split(".")
    return any(matches(p, ".".join(parts[:i])) for p in patterns for i in range(1, len(parts) + 1))
