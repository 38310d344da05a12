"""The MoE router's load-balancing loss under pipeline parallelism, as one process computes it.

transformers' auxiliary loss is a product of two averages over every token and every layer of a forward (the
fraction of assignments each expert gets, and its mean routing probability), so per-stage losses do not add
up to it. The router logits therefore travel down the pipeline with the hidden states: each stage records its
routers' logits as transformers records them (the modules and output index of ``_can_record_outputs
["router_logits"]``, after the tp and cp gathers, which plait installs ahead of any other hook) and sends on,
beside its hidden states, one tensor stacking the logits of every router so far, [routers, tokens, experts].
The last stage calls the model's own ``load_balancing_loss_func`` on all layers' logits, with the arguments
the CausalLM's forward passes, and hands ``router_aux_loss_coef`` times it to the loss (``PipelineRunner``
averages it over a step's forwards, as ``ParallelModel`` does at pp=1). Backward runs through the same
tensors, so every stage's routers get the gradient one process gives them.

Carried logits, not per-expert statistics: running sums of assignments and probabilities (2 x experts + 1
numbers) would be exact too, but computing them re-implements the loss's internals, which differ between
transformers versions and models, and a detail missed would be silently wrong; carrying the logits lets the
model's own function compute it. The price is bandwidth: per token, routers so far x experts numbers beside the
hidden states' hidden_size (at pp=2, Mixtral-8x7B 16 x 8 = 128 beside 4096; Qwen3-235B-A22B 47 x 128 = 6016
beside 4096). Models whose CausalLM computes the loss otherwise are refused (``router_aux``), as are those
recording no router logits.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from plait.base.config import ConfigError
from plait.cp.router import router_recorders

# The call every transformers MoE CausalLM with this loss makes (mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss,
# ...), whitespace removed; doge (another signature), jetmoe (another coefficient) and the vision-language models
# (text_config's arguments) differ, and deepseek_v3 and its kin compute no such loss.
_CALL = re.compile(r"load_balancing_loss_func\(outputs\.router_logits,self\.num_experts,self\.num_experts_per_tok,"
                   r"attention_mask,?\)")
_WEIGHT = "loss+=self.router_aux_loss_coef*aux_loss"
_EXPECTED = ("`load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, "
             "attention_mask)` added as `self.router_aux_loss_coef * aux_loss`")


@dataclass(frozen=True)
class RouterAux:
    """The load-balancing loss as the model's CausalLM computes it: its modeling module's function and the
    arguments its forward passes."""

    loss: Callable[..., torch.Tensor]
    num_experts: int
    top_k: int
    coef: float

    def term(self, logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> torch.Tensor:
        """What the CausalLM adds to one forward's loss: ``coef`` times the aux loss of all layers' logits."""
        return self.coef * self.loss(logits, self.num_experts, self.top_k, attention_mask)


def router_aux(model: nn.Module, where: str = "under pipeline parallelism",
               fix: str = "set output_router_logits=False or pp=1") -> RouterAux | None:
    """The aux loss a pipeline's last stage computes for ``model`` (a transformers MoE CausalLM), or None when
    ``output_router_logits`` is off. ConfigError, before any collective, for a model whose forward computes it
    some other way: only this call is repeated exactly. ``where`` and ``fix`` word the refusal for the caller
    (plait.parallel.moe_balance's global-batch loss rests on the same call)."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    name = type(model).__name__
    if not router_recorders(model):
        raise ConfigError(
            f"output_router_logits=True {where}, but {name} records no router logits "
            f"(`_can_record_outputs['router_logits']`) for plait to compute its loss from; {fix}"
        )
    forward = inspect.unwrap(type(model).forward)
    try:
        source = re.sub(r"\s+", "", inspect.getsource(forward))
    except (OSError, TypeError):
        source = ""
    takes_flag = "output_router_logits" in inspect.signature(forward).parameters  # the stages pass it False
    if not (takes_flag and len(_CALL.findall(source)) == 1 and _WEIGHT in source):
        raise ConfigError(
            f"output_router_logits=True {where}: {name}.forward does not compute its "
            f"load-balancing loss as {_EXPECTED}, the call plait repeats on the router logits it records; "
            f"{fix}"
        )
    return RouterAux(forward.__globals__["load_balancing_loss_func"], model.num_experts, model.num_experts_per_tok,
                     model.router_aux_loss_coef)


class RouterRecorder:
    """Appends this stage's routers' logits to a list during its forward, in call order, as transformers' own
    hook records them (output ``index`` of each recorded module, when not None). Inert outside ``recording``:
    a recomputation in backward (activation checkpointing) records nothing."""

    def __init__(self, stage: nn.Module) -> None:
        self._into: list[torch.Tensor] | None = None
        recorders = router_recorders(stage)
        for module in stage.modules():  # this stage's own routers: other stages' layers are placeholders
            for target, index in recorders:
                if isinstance(module, target):
                    module.register_forward_hook(functools.partial(self._record, index=index))

    @contextlib.contextmanager
    def recording(self, into: list[torch.Tensor]) -> Iterator[None]:
        """Record into ``into`` (after the earlier stages' logits it holds) until the context ends."""
        self._into = into
        try:
            yield
        finally:
            self._into = None

    def _record(self, module: nn.Module, args, output, index: int) -> None:
        if self._into is None:
            return
        logits = output[index] if isinstance(output, tuple) else output
        if logits is not None:
            self._into.append(logits)
