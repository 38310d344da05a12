"""The MoE router's load-balancing loss over the global batch (``ParallelConfig(moe_aux_loss_scope="global_batch")``).

transformers' loss of one forward (Switch Transformer's, as its ``load_balancing_loss_func`` sums it over layers) is

    aux = E * sum_e f_e * P_e,    f_e = A_e / R,    P_e = S_e / R

with A_e the top-k assignments of (token, layer) rows to expert e, S_e their routing probabilities of e summed,
and R the rows (tokens x layers, weighted by the padding mask). Under the default scope, ``micro_batch``, plait
trains on the mean over a step's forwards of each forward's ``aux``: transformers' definition, but its value
depends on how the step is cut into forwards (dp and cp ranks, microbatches, accumulation steps), so one process
at batch 4 and dp=2 x 2 train on different losses. ``global_batch`` (Qiu et al. 2025, "Demons in the Detail";
Megatron's ``global_aux_loss``) takes A, S and R over every token of the optimizer step: one loss, the same for
every layout, and the one process computes it on the whole batch in one forward.

Gradient accumulation. ``f`` is a count (it has no gradient) while every row's probabilities have one, so

    d(coef * aux) = sum over forwards of  sum_e w_e dS_e(forward),    w = coef * E * A / R^2 (the whole step's)

Each forward's backward needs only the E numbers ``w``, but they need the routing of every forward of the step,
on every rank, before the first backward. plait gets them from a routing pass: the step's batches run forward
once without autograd (at pp > 1 through the schedule's evaluation), each forward's router logits (those
transformers records, after plait's tp and cp gathers) are counted into (A, R), and one all-reduce over dp sums
them. The training forwards then add ``sum_e w_e S_e(forward)``, divided by cp (every cp rank holds the whole
forward's logits, plait.cp.router); the gradient sums over forwards and ranks give the exact gradient, and the
values sum to the global loss. The price is one forward per step without backward (+40% of a step measured on
the CPU, docs/design-notes.md). Rejected: Megatron's running counts (each micro-batch's all-reduced
counts averaged with the earlier ones': early micro-batches see other counts, so neither value nor gradient is the
global batch's), keeping every forward's graph until the counts are known (the memory accumulation exists to
save), and one gradient per expert weighed at the end (E copies of the gradient).

The routing pass must route exactly as the training forwards do, so a forward that draws random numbers (dropout,
router jitter) is refused; and since plait recomputes the loss from the logits (the model's function takes no
counts from outside), it first checks on a probe that the model's own function is this formula.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.base import comm
from plait.base.config import ConfigError, ParallelConfig
from plait.pipeline.router import RouterAux, router_aux

if TYPE_CHECKING:
    from peft import LoraConfig

SCOPE = "moe_aux_loss_scope='global_batch'"
_RANDOM = re.compile(r"dropout|pdrop|jitter")  # config fields whose non-zero value makes a forward draw numbers


def routing_counts(logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                   attention_mask: torch.Tensor | None) -> torch.Tensor:
    """float64 [E + 1]: each expert's top-k assignments over every layer's rows of one forward, then the rows
    (the mask's kept tokens x layers); as transformers' function counts them (top-k of the softmax, in the logits'
    dtype)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.float64, device=logits[0].device)
    flat = None if attention_mask is None else attention_mask.reshape(-1).to(logits[0].device, torch.float64)
    with torch.no_grad():
        for layer in logits:
            _, chosen = torch.topk(torch.softmax(layer, dim=-1), top_k, dim=-1)
            weight = torch.ones(chosen.numel(), dtype=torch.float64, device=chosen.device) if flat is None \
                else flat.repeat_interleave(top_k)
            counts[:num_experts].scatter_add_(0, chosen.reshape(-1), weight)
            counts[-1] += layer.shape[0] if flat is None else flat.sum()
    return counts


def probability_sums(logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None) -> torch.Tensor:
    """fp32 [E], differentiable: each expert's routing probability summed over every layer's (kept) rows."""
    flat = None if attention_mask is None else attention_mask.reshape(-1, 1).to(logits[0].device, torch.float32)
    total = None
    for layer in logits:
        probs = torch.softmax(layer, dim=-1).float()
        part = (probs if flat is None else probs * flat).sum(dim=0)
        total = part if total is None else total + part
    return total


def check_global_scope(model: nn.Module, config: ParallelConfig, lora: LoraConfig | None = None) -> None:
    """Refuse, before any collective, a model ``moe_aux_loss_scope='global_batch'`` cannot serve exactly."""
    if config.moe_aux_loss_scope != "global_batch":
        return
    name = getattr(model.config, "model_type", type(model).__name__)
    if not getattr(model.config, "output_router_logits", False):
        raise ConfigError(f"{SCOPE}, but {name} computes no load-balancing loss (output_router_logits is off in its "
                          f"config); set output_router_logits=True in the model config, or leave "
                          f"moe_aux_loss_scope='micro_batch'")
    aux = router_aux(model, where=f"with {SCOPE}", fix="use moe_aux_loss_scope='micro_batch'")
    drawn = [f"{key}={value}" for key, value in model.config.to_dict().items()
             if _RANDOM.search(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0]
    drawn += [f"{module_name} (dropout p={module.p})" for module_name, module in model.named_modules()
              if isinstance(module, nn.Dropout) and module.p > 0]
    if lora is not None and lora.lora_dropout:
        drawn.append(f"lora_dropout={lora.lora_dropout}")
    if drawn:
        raise ConfigError(f"{SCOPE} counts the step's routing in a pass before the training forwards, which must "
                          f"route alike, but {name}'s forward draws random numbers ({', '.join(drawn)}); set "
                          f"{'them' if len(drawn) > 1 else 'it'} to 0, or use moe_aux_loss_scope='micro_batch'")
    _check_probe(aux, name)


def _check_probe(aux: RouterAux, name: str) -> None:
    """The model's own loss function equals E * sum_e (A_e / R) (S_e / R) on random logits, with and without a
    padding mask: plait computes the global loss from those sums, so a model whose function differs is refused."""
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, aux.num_experts, generator=gen) for _ in range(2))
    for mask in (None, torch.tensor([[1, 1, 0], [1, 1, 1]])):
        counts = routing_counts(logits, aux.num_experts, aux.top_k, mask)
        rows = counts[-1]
        mine = aux.num_experts * (counts[:-1] / rows * probability_sums(logits, mask).double() / rows).sum()
        theirs = torch.as_tensor(aux.loss(logits, aux.num_experts, aux.top_k, mask), dtype=torch.float64)
        if not torch.isclose(mine, theirs, rtol=1e-5, atol=0):
            raise ConfigError(f"{SCOPE}: {name}'s load_balancing_loss_func gives {theirs.item():.6g} on a probe where "
                              f"E * sum_e f_e * P_e (the sums plait takes over the global batch) gives "
                              f"{mine.item():.6g}; use moe_aux_loss_scope='micro_batch'")


class GlobalBalance:
    """One step's global-batch load balancing on this rank: ``routing_pass()`` around the no-grad forwards of the
    step's batches counts their routing, ``finish()`` sums the counts over ``group`` (dp) into the weights, and
    ``term`` then gives each training forward its part of the step's loss (see the module's docstring).

    ``pending``: the input shapes of the ``train_step`` calls the weights were counted for, in order
    (``ParallelModel.set_global_batch``); each call takes one."""

    def __init__(self, aux: RouterAux, group: Any) -> None:
        self.aux, self.group = aux, group
        self.weights: torch.Tensor | None = None  # float64 [E]: coef * E * A / R^2 of the step
        self.pending: list[tuple[int, ...]] = []
        self._counts: list[torch.Tensor] | None = None  # during the routing pass

    @contextlib.contextmanager
    def routing_pass(self) -> Iterator[None]:
        """Count, instead of computing terms, every forward's routing until the context ends."""
        self._counts = []
        try:
            yield
        except BaseException:
            self._counts = None
            raise

    def finish(self) -> None:
        """Sum the routing pass's counts over dp (a collective: every rank of the group calls it) into the step's
        weights. Under pp, stages other than the last counted nothing and hold weights they never use."""
        counts, self._counts = self._counts or [], None
        device = comm.device_for(self.group)
        total = torch.zeros(self.aux.num_experts + 1, dtype=torch.float64, device=device)
        for part in counts:
            total += part.to(device)
        comm.all_reduce(total, self.group)
        rows = total[-1].clamp(min=1)  # no row at all (every token masked): every count is 0, and the loss is too
        self.weights = self.aux.coef * self.aux.num_experts * total[:-1] / rows**2

    def term(self, logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The whole forward's part of ``coef * aux`` (its logits are the whole forward's on every cp and tp rank):
        ``sum_e w_e S_e``; during the routing pass, its counts are taken and zero is returned."""
        if self._counts is not None:
            self._counts.append(routing_counts(logits, self.aux.num_experts, self.aux.top_k, attention_mask))
            return logits[0].new_zeros((), dtype=torch.float32)
        if self.weights is None:
            raise RuntimeError("a training forward under moe_aux_loss_scope='global_batch' before any routing pass")
        probs = probability_sums(logits, attention_mask)
        return (self.weights.to(probs.device, probs.dtype) * probs).sum()

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Restore the weights and pending calls when the context ends (an evaluation between a step's calls)."""
        weights, pending = self.weights, list(self.pending)
        try:
            yield
        finally:
            self.weights, self.pending = weights, pending


def global_balance(model: nn.Module, config: ParallelConfig, dp_group: Any) -> GlobalBalance | None:
    """The global-batch balancing of ``model`` (already checked by ``plan_layout``), or None under micro_batch."""
    if config.moe_aux_loss_scope != "global_batch":
        return None
    return GlobalBalance(router_aux(model, where=f"with {SCOPE}", fix="use moe_aux_loss_scope='micro_batch'"),
                         dp_group)


def aux_divisor(config: ParallelConfig, calls: int = 1) -> int:
    """What each forward's aux term is divided by: micro_batch averages over the step's forwards (every dp and cp
    rank's microbatches of each of the step's ``calls`` to ``train_step``, its gradient accumulation); global_batch's
    terms already sum to the step's loss, each cp rank adding 1/cp of its forward's (which it computes whole)."""
    if config.moe_aux_loss_scope == "global_batch":
        return config.cp
    return (config.dp or 1) * config.cp * config.num_microbatches * calls
