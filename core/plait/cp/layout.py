"""What context parallelism can do for a model, decided on the (meta) model before any process group.

Everything but attention runs per token, so cp is exact for a model whose only sequence mixing is attention
built with transformers' mask builders. Refused, naming the module or field: recurrent and linear-attention
mixers (Mamba, RWKV, gated delta nets, short convolutions: their state crosses the slices), models that
build masks on their own, and the MoE router's auxiliary loss where transformers records no router logits
to gather (plait.cp.router).

The two strategies (plait.cp.ulysses, plait.cp.ring) have their own limits: all-to-all needs the query
heads of a tp rank to divide by C, and attention code that reads no per-head parameter off its module
(gpt_oss's sinks are); the ring has no exact attention dropout. ``auto`` takes all-to-all where
it applies, since it moves fewer bytes and runs the model's own attention code, except on sequences longer
than ``RING_FROM`` tokens, where the whole-sequence mask it materialises (S^2 per sequence) costs more than
the ring's blocks; the ring otherwise.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from plait.base.config import ConfigError, ParallelConfig
from plait.base.meta import image_text_model
from plait.cp.masks import mask_builders
from plait.cp.router import router_recorders

RING_FROM = 32768  # tokens: above this auto prefers the ring (all-to-all's mask would be >= 1 GiB a sequence)
# words of a module class name (CamelCase split into snake_case) that name a recurrent or convolutional mixer
_RECURRENT = re.compile(r"(?:^|_)(mamba|rwkv|delta_net|linear_attention|lightning|short_conv|ssm|retention|"
                        r"recurrent|xlstm|hyena)(?:_|$|\d)")
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
_STATEFUL_LAYERS = {"linear_attention", "conv", "mamba", "recurrent", "rwkv", "ssm", "deltanet", "lightning"}
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


@dataclass(frozen=True)
class CPPlan:
    """The cp size, the strategy asked for, and why each strategy does not apply (None: it does)."""

    size: int
    requested: str
    all_to_all_refusal: str | None
    ring_refusal: str | None

    def strategy_for(self, seq: int) -> str:
        """The strategy a forward over ``seq``-token sequences uses."""
        if self.requested != "auto":
            return self.requested
        if self.all_to_all_refusal is None and (self.ring_refusal is not None or seq <= RING_FROM):
            return "all-to-all"
        return "ring"

    def describe(self) -> str:
        if self.requested != "auto":
            return self.requested
        if self.all_to_all_refusal is None and self.ring_refusal is None:
            return f"auto: all-to-all up to {RING_FROM} tokens, ring beyond"
        return f"auto: {'ring' if self.all_to_all_refusal else 'all-to-all'}"


def plan_context_parallel(model: nn.Module, config: ParallelConfig) -> CPPlan | None:
    """The cp plan of ``model`` under ``config`` (None at cp=1); raises ConfigError for what cp cannot match."""
    if config.cp == 1:
        return None
    mc = model.config.get_text_config()  # an image-text model: its language model's
    # an image-text model's vision tower runs whole on every cp rank (plait.cp.images): only its language model splits
    _check_mixers(model.get_decoder() if image_text_model(model) else model, mc)
    if not mask_builders(model):
        raise ConfigError(
            f"context parallelism needs the model to build its attention masks with transformers.masking_utils; "
            f"{type(model).__module__} does not; use cp=1"
        )
    if getattr(mc, "output_router_logits", False) and not router_recorders(model):
        raise ConfigError(
            f"output_router_logits=True under context parallelism: the aux loss averages over every token, and "
            f"{type(model).__name__} records no router logits plait can gather over cp; set "
            f"output_router_logits=False or use cp=1"
        )
    heads = getattr(mc, "num_attention_heads", None)
    local_heads = heads // config.tp if heads else None
    all_to_all = None
    sinks = next((name for name, m in model.named_modules() if isinstance(getattr(m, "sinks", None), nn.Parameter)), None)
    if not local_heads or local_heads % config.cp:
        all_to_all = (f"all-to-all needs the attention heads of a tp rank ({heads} / tp={config.tp} = {local_heads}) "
                      f"to divide by cp={config.cp}")
    elif sinks is not None:
        all_to_all = (f"all-to-all hands the model's attention a subset of the heads, but {sinks}.sinks (per-head "
                      f"attention sinks) is read whole off the module")
    dropout = {f: getattr(mc, f) for f in _DROPOUT_FIELDS if getattr(mc, f, 0)}
    ring = None
    if dropout:
        field, value = next(iter(dropout.items()))
        ring = f"the ring has no exact attention dropout ({field}={value}); set it to 0"
    plan = CPPlan(config.cp, config.cp_attention, all_to_all, ring)
    refusal = {"all-to-all": all_to_all, "ring": ring}.get(config.cp_attention)
    if config.cp_attention == "auto" and all_to_all and ring:
        refusal = f"{all_to_all}, and {ring}"
    if refusal:
        # the other strategy where it runs (auto picks it), else no context parallelism
        other = {"all-to-all": ("ring", ring), "ring": ("all-to-all", all_to_all)}.get(config.cp_attention)
        fix = f"use cp_attention={other[0]} (or auto, which picks it)" if other and other[1] is None else "use cp=1"
        raise ConfigError(f"cp_attention={config.cp_attention}: {refusal}; {fix}")
    return plan


def _check_mixers(model: nn.Module, model_config: Any) -> None:
    """Refuse sequence mixers other than attention, naming the first one found."""
    for kind in getattr(model_config, "layer_types", None) or ():
        if kind in _STATEFUL_LAYERS:
            raise ConfigError(
                f"layer type {kind!r} (config.layer_types) carries state along the sequence, which context "
                f"parallelism cannot split exactly; use cp=1"
            )
        if kind not in _ATTENTION_LAYERS:
            raise ConfigError(
                f"layer type {kind!r} (config.layer_types) is not one context parallelism knows to split exactly "
                f"({', '.join(sorted(_ATTENTION_LAYERS))}); use cp=1"
            )
    for name, module in model.named_modules():
        words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(module).__name__).lower()
        if _RECURRENT.search(words) or isinstance(module, nn.Conv1d):
            raise ConfigError(
                f"{name} ({type(module).__name__}) mixes the sequence without attention, which context "
                f"parallelism cannot split exactly; use cp=1"
            )
        if re.search(r"CrossAttention|CrossAttn", type(module).__name__) and any(
                isinstance(m, nn.Linear) for m in module.children()):
            raise ConfigError(
                f"{name} ({type(module).__name__}) is cross-attention: its keys and values come from another "
                f"sequence (BLT's patches, Mllama's image), under a mask the model builds itself, which context "
                f"parallelism does not split; use cp=1"
            )
        if _computes_attention_itself(module):
            raise ConfigError(
                f"{name} ({type(module).__name__}) computes attention itself, not through transformers' attention "
                f"functions, which is where context parallelism splits it; use cp=1"
            )


def _computes_attention_itself(module: nn.Module) -> bool:
    """An attention module (by its class name, holding its own projections) whose forward does not call
    transformers' attention functions (``ALL_ATTENTION_FUNCTIONS``): Bloom's ``baddbmm`` with ALiBi, GPT-Neo's
    matmuls. Context parallelism replaces those functions and hands the model a mask object of its own, which such
    code would add to its scores."""
    cls = type(module)
    if not re.search(r"Attention|Attn", cls.__name__) or not any(isinstance(m, nn.Linear) for m in module.children()):
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" not in source and "attention_interface" not in source
