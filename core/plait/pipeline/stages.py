"""Pipeline stages built by module name from a ``StageSplit`` (docs/decisions.md D3, D4).

Each rank keeps only the modules of its own stages (``prune``), so a meta-built model never materialises
another stage's parameters. Each stage runs the transformers model's own forward, so position ids, rotary
tables and the causal mask (with the batch's padding mask) are rebuilt locally on every stage; the
modules it does not own are swapped for placeholders in a per-stage shell of the model.

Only the stage's own layers touch real activations. Stages after the first hand transformers a free
stand-in for ``inputs_embeds`` of the full sequence shape, and a pre-hook on the stage's first layer swaps
in the hidden states received from the previous stage; stages before the last take their last layer's
output (what is sent on) and hand a stand-in to the rest of the forward. Hence the stand-ins: under
sequence parallelism the hidden states between stages are sequence shards, but transformers must see the
full sequence length to build the mask and rotary tables (docs/decisions.md D2), and code after the layers
may reshape by it (GPT2's final ``view``). Where the plan says ``token_ids`` (per-layer inputs computed from
the token ids: Gemma's per-layer embeddings, DeepSeek-V4's hash routing), stages after the first run the
model on the token ids instead, which every rank of the pipeline reads; the input embedding there (unless every
stage holds it) is a ``ZeroEmbedding``, whose output the first layer's pre-hook replaces likewise.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._composable_state import _insert_module_state
from torch.distributed.fsdp import FSDPModule

from plait.base.images import ImageBatch
from plait.cp.context import ContextParallel
from plait.pipeline.cuts import StageSplit
from plait.pipeline.router import RouterRecorder, router_aux



def share_state(unit: nn.Module, copied: nn.Module) -> None:
    """Let a shallow copy of an FSDP unit (a pipeline stage's shell of the model, ``pipeline.stages.shell``) run as
    that unit: torch finds a unit's state by module object, so the copy is registered under the same state."""
    if isinstance(unit, FSDPModule):
        _insert_module_state(copied, unit._get_fsdp_state())

class Absent(nn.Module):
    """A module owned by another stage, which this stage's forward never calls (an input embedding when
    the stage is fed ``inputs_embeds``). Holds no parameters; calling it is a bug worth a clear error.

    One call of an absent input embedding is answered (``embedding_dim`` set): the embedding of a single token
    id (a 0-dim tensor), which multimodal models compare ``inputs_embeds`` with to find their image, video or
    audio placeholders when they have no input ids (Gemma-4-unified, on every forward). It is NaN, equal to no
    hidden state: no position is a placeholder, as on the first stage, which finds them in the ids (and the
    mask matters only where the stage's forward merges encoder features, which text training never hands it)."""

    def __init__(self, name: str, owner: int | None, embedding_dim: int | None = None) -> None:
        super().__init__()
        self.name, self.owner, self.embedding_dim = name, owner, embedding_dim

    def forward(self, *args, **kwargs):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("input"))
        if self.embedding_dim is not None and isinstance(ids, torch.Tensor) and ids.dim() == 0 \
                and not ids.is_floating_point():
            return torch.full((self.embedding_dim,), float("nan"), device=ids.device)
        raise RuntimeError(
            f"{self.name} belongs to pipeline stage {self.owner} but was called on another stage; add it to "
            f"the pipeline plan's neutralize list if every stage's forward calls it"
        )


class PassThrough(nn.Module):
    """Returns its hidden-states input: other stages' layers, and the final norm and head on earlier stages.

    It keeps the plain attributes of the module it stands for, its class's included (not its methods,
    submodules, parameters or tensors): some models' forwards read them off every layer to choose that layer's
    inputs (Nemotron-H's ``block_type``, Inkling2's class-level ``attention_type``). The choice is then made
    as on one process, and ignored. For a ``weight`` it keeps an empty tensor of its dtype: Mamba's CausalLM casts
    the hidden states to ``self.lm_head.weight.dtype`` on every stage."""

    def __init__(self, original: nn.Module | None = None) -> None:
        super().__init__()
        if original is None:
            return
        found: dict = {}
        for cls in reversed(type(original).__mro__):
            if cls not in nn.Module.__mro__:
                found.update({k: v for k, v in vars(cls).items() if not hasattr(type(v), "__get__")})
        found.update(vars(original))
        for key, value in found.items():
            plain = not isinstance(value, (nn.Module, torch.Tensor)) and not hasattr(PassThrough, key)
            if plain and not key.startswith("_") and key != "training":
                setattr(self, key, value)
        weight = original._parameters.get("weight")
        if weight is not None:  # Mamba casts by ``self.lm_head.weight.dtype`` on every stage; the stage drops the
            # result. A plain attribute, not a buffer: no state, and no name beside the real parameter's
            self.weight = torch.empty(0, dtype=weight.dtype)

    form: LayerForm | None = None  # set on stand-ins for decoder layers (StageChunk): the real layers' return form

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return hidden if self.form is None else self.form.wrap(hidden)


class LayerForm:
    """What the real decoder layers of a rank return: the hidden states alone (Llama, GPT2) or a tuple of them
    and more (GPT-Neo's ``(hidden_states, attn_weights)``, which its model indexes with ``[0]``). Recorded by a
    hook on the stage's own layers, so that a stand-in for another stage's layer returns the same form: a bare
    tensor where the model indexes a tuple would cut the batch dimension off the stand-in hidden states.

    One per rank's model: the stand-ins of layers no stage of the rank owns are shared by its stages. Before any
    own layer has run (stand-ins ahead of a later stage's first layer, in the first forward), the stand-in returns
    the bare tensor, or the plan's tuple where the model unpacks the layers' return (``PipelinePlan.layer_outputs``);
    whatever it turns into there is replaced by the received hidden states at that layer."""

    def __init__(self, outputs: int = 0, none: tuple[int, ...] = ()) -> None:
        # entries after the hidden states; None: a bare tensor (or not yet seen). ``outputs``: what the plan
        # knows before any layer runs (``PipelinePlan.layer_outputs``, where the model unpacks the layer's return)
        self.extra: int | None = outputs - 1 if outputs > 1 else None
        self.kind: type = tuple  # a list where the layers return one (GPT-1's blocks)
        self.none = none  # entries the model hands to the next layer, which must be None (a cache without use_cache)

    def record(self, module: nn.Module, args, output) -> None:
        if any(output[i] is not None for i in self.none):
            raise RuntimeError(
                f"{type(module).__name__} returned something other than None in entries {list(self.none)} of its "
                f"output, which the model hands to the next layer; pipeline stages hand on only the hidden "
                f"states: use pp=1")
        self.extra = len(output) - 1 if isinstance(output, (tuple, list)) else None
        self.kind = list if isinstance(output, list) else tuple

    def wrap(self, hidden: torch.Tensor):
        return hidden if self.extra is None else self.kind((hidden, *([None] * self.extra)))


_FORMS: weakref.WeakKeyDictionary[nn.Module, LayerForm] = weakref.WeakKeyDictionary()


class ZeroEmbedding(nn.Module):
    """The input embedding on a stage that does not own it but runs the model on the token ids
    (``PipelinePlan.token_ids``): zeros of the embedding's output shape and dtype, materialised (some models
    scale the embeddings in place), which the stage's first layer never sees (the received hidden states
    replace them)."""

    def __init__(self, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.dtype = embedding_dim, dtype

    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros((*input_ids.shape, self.embedding_dim), dtype=self.dtype, device=input_ids.device)


class ZeroContribution(nn.Module):
    """A neutralised additive embedding (GPT2 position embeddings on later stages): adds nothing.

    It takes whatever the model passes the embedding it stands for: GPT2 calls ``wpe(position_ids)``, OPT
    ``embed_positions(attention_mask, past_length, position_ids=...)``."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        like = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        # a 0-dim tensor never changes the sum's dtype
        return torch.zeros((), dtype=torch.float32, device=None if like is None else like.device)


def _placeholder(model: nn.Module, split: StageSplit, name: str) -> nn.Module:
    module = model.get_submodule(name)
    if name in split.layers or name in split.owned_last():
        return _stand_in(module, PassThrough)
    if name in split.plan.neutralize:
        return _stand_in(module, lambda m: ZeroContribution() if isinstance(m, nn.Embedding) else PassThrough(m))
    if isinstance(module, nn.Embedding) and split.plan.token_ids:
        return ZeroEmbedding(module.embedding_dim, module.weight.dtype)
    return Absent(name, split.stage_of(name), module.embedding_dim if isinstance(module, nn.Embedding) else None)


def _stand_in(module: nn.Module, make: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``make(module)``, or for a ModuleList a ``StandInList`` of ``make`` of each entry."""
    return StandInList([make(m) for m in module]) if isinstance(module, nn.ModuleList) else make(module)


class StandInList(nn.ModuleList):
    """Stand-ins for a ModuleList of another stage's, which the forward indexes on every stage (Gemma-3n's altup
    projections, before and after the layers: ``self.altup_projections[i - 1](hidden_states_0)``)."""


def _replacements(model: nn.Module, split: StageSplit, stages: Iterable[int]) -> dict[str, nn.Module]:
    """Placeholders for every pipeline unit that ``stages`` neither own nor recompute."""
    stages = set(stages)
    out = {}
    for name in (*split.plan.first, *split.layers, *split.plan.last):
        owner = split.stage_of(name)
        present = owner in stages if owner is not None else (name not in split.plan.neutralize or 0 in stages)
        if not present and not is_placeholder(model.get_submodule(name)):
            out[name] = _placeholder(model, split, name)
    return out


def prune(model: nn.Module, split: StageSplit, stages: list[int]) -> None:
    """Drop, in place, every module that none of ``stages`` owns (before any materialisation of a meta
    model); parameter names of the kept modules stay those of the original model."""
    for name, placeholder in _replacements(model, split, stages).items():
        model.set_submodule(name, placeholder)
    if 0 not in stages:  # the first stage's own parameters of the modules holding the layers
        for name in split.plan.first_params:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_parameter(leaf, None)


def shell(module: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` with the named submodules replaced; every other module (and every
    parameter) is shared with ``module``. Lets the stages of one rank share its pruned model."""
    if not replacements:
        return module
    # copy.copy would run the class's __new__, which FSDP2's module classes make call __init__ again (ZeRO-3)
    copied = object.__new__(type(module))
    copied.__dict__.update(module.__dict__)
    share_state(module, copied)
    copied._modules = dict(module._modules)
    nested: dict[str, dict[str, nn.Module]] = defaultdict(dict)
    for name, new in replacements.items():
        head, _, rest = name.partition(".")
        if rest:
            nested[head][rest] = new
        else:
            copied._modules[head] = new
    for head, inner in nested.items():
        copied._modules[head] = shell(module._modules[head], inner)
    return copied


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: it is sent to the previous stage, and
    point-to-point sends and receive buffers need dense tensors (sequence-parallel gradients arrive as
    transposed views)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageChunk(nn.Module):
    """One pipeline stage: ``forward(x, *received, attention_mask=None, position_ids=None, token_ids=None)``
    maps the previous stage's output (input ids on the first stage) to the next stage's input (logits on the
    last stage). ``token_ids``: the microbatch's input ids, which every stage gets where the plan says
    ``token_ids``; stages after the first then run the model on them.

    Beside the hidden states a stage sends the values its last layer returns that the model hands to the next
    layer (the plan's ``carried``: GLM-MoE-DSA's top-k indices), and the next stage's first layer gets them under
    their keyword; then the router logits (below). ``received`` is those, in that order.

    ``seq_shards`` is how many sequence shards the hidden states between stages are cut into (tp under
    sequence parallelism, else 1). ``after_forward`` runs after every forward (it clears the TP entry cache);
    ``forward_context`` makes the context each forward runs in (autocast, when asked for). ``cp``: under
    context parallelism, the stage gets this rank's slice of ``x`` with the whole sequence's position ids
    and padding mask, and runs inside ``cp.forward`` (which hands the model their slices).

    When the model's config asks for the router's load-balancing loss (``output_router_logits``), the stage
    takes and hands on the router logits of every stage so far (``router_logits``, [routers, tokens, experts],
    once there are any), and the last stage returns (logits, the aux term of the microbatch) instead of logits
    (plait.pipeline.router). Its own CausalLM is told not to compute a loss of its stage's routers alone.
    ``aux_term``: computes that term from all layers' logits and the mask instead of the model's own function
    (plait.parallel.moe_balance's global-batch term); not called on the garbage of a shape-learning forward.
    """

    def __init__(
        self, pruned: nn.Module, split: StageSplit, stage: int, seq_shards: int, after_forward: Callable[[], None],
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        cp: ContextParallel | None = None,
        aux_term: Callable[[tuple[torch.Tensor, ...], torch.Tensor | None], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self._forward_context, self.cp, self._aux_term = forward_context, cp, aux_term
        self.shell = shell(pruned, _replacements(pruned, split, [stage]))
        self.stage, self.seq_shards, self._after_forward = stage, seq_shards, after_forward
        self.is_first, self.is_last = stage == 0, stage == split.num_stages - 1
        self.token_ids, self.carried = split.plan.token_ids, split.plan.carried
        start, stop = split.bounds[stage]
        self.first_layer = start  # the index of this stage's first decoder layer (its KV cache's first entry)
        self._incoming: torch.Tensor | None = None
        self._outgoing: torch.Tensor | None = None
        self._carried_in: dict[str, torch.Tensor] = {}  # keyword -> value, for this stage's first layer
        self._carried_out: list[torch.Tensor] = []  # this stage's last layer's, to send on
        self.shapes_only = False  # set by the runner while torch runs a forward to learn shapes (garbage inputs)
        self._seq = 0  # full sequence length of the running forward; 0 outside it (hooks stay inert)
        self.router_aux = router_aux(pruned)
        self._routers = RouterRecorder(self.shell) if self.router_aux is not None else None
        form = _FORMS.setdefault(pruned, LayerForm(split.plan.layer_outputs, split.plan.none_outputs))
        for index, name in enumerate(split.layers):
            layer = self.shell.get_submodule(name)
            if isinstance(layer, PassThrough):
                layer.form = form
            elif start <= index < stop:
                layer.register_forward_hook(form.record)
        if not self.is_first:
            self.shell.get_submodule(split.layers[start]).register_forward_pre_hook(self._swap_in, with_kwargs=True)
        if not self.is_last:
            self.shell.get_submodule(split.layers[stop - 1]).register_forward_hook(self._take_out)

    def forward(self, x: torch.Tensor, *received: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                images: dict[str, torch.Tensor] | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        carried = () if self.is_first else received[:len(self.carried)]
        router_logits = received[len(carried)] if len(received) > len(carried) else None
        self._carried_in = {keyword: _received(value, self.shapes_only)
                            for (_, keyword), value in zip(self.carried, carried)}
        # an image-text model's images (its micro-batch's rows): the first stage's vision tower reads the pixels,
        # every stage's model the per-token tensors (Gemma 3's token types, which its masks follow)
        batch = ImageBatch.from_rows(images) if images is not None else None
        pictures = {} if batch is None else batch.inputs() if self.is_first else batch.later_stage_inputs()
        if position_ids is not None and position_ids.dim() == 3:  # M-RoPE's [rows, 3, seq], cut by rows
            position_ids = position_ids.transpose(0, 1)
        if self.cp is not None:
            whole = self.cp.forward(x.shape[0], position_ids.shape[1], attention_mask, position_ids, x.device)
            with whole as local:
                return self._forward(x, router_logits, token_ids=token_ids, **local, **pictures)
        return self._forward(x, router_logits, attention_mask, position_ids, token_ids, **pictures)

    def decode_step(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    token_ids: torch.Tensor, **cache: Any) -> torch.Tensor:
        """One decoding forward of this stage (``ParallelModel.generate``): the ids (first stage) or the previous
        stage's hidden states in, with the stage's own KV cache (``cache``: the cache under the forward's name,
        ``use_cache``, ``logits_to_keep``); the hidden states to send on, or on the last stage the logits."""
        return self._forward(x, None, attention_mask, position_ids, token_ids, **cache)

    def _forward(self, x: torch.Tensor, router_logits: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                 **cache: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``cache``: decoding's KV cache and use_cache, or the first stage's image inputs."""
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self._routers is not None:
            kwargs["output_router_logits"] = False  # the aux loss is the last stage's, over every stage's routers
        if self.is_first:
            self._seq = x.shape[1]
            kwargs["input_ids"] = x
        elif self.token_ids:  # the model computes what it computes from the ids; the first layer gets ``x``
            self._seq = token_ids.shape[1]
            kwargs["input_ids"] = token_ids
            self._incoming = _ContiguousGrad.apply(x)
        else:
            self._seq = x.shape[1] * self.seq_shards
            # materialised, not an expanded scalar: some models scale or add to inputs_embeds in place (CTRL, GIT)
            kwargs["inputs_embeds"] = x.new_zeros(x.shape[0], self._seq, x.shape[2])
            self._incoming = _ContiguousGrad.apply(x)
        routers = [] if router_logits is None else list(_ContiguousGrad.apply(router_logits).unbind())
        recording = self._routers.recording(routers) if self._routers is not None else contextlib.nullcontext()
        aux = None
        try:
            with self._forward_context(), recording:
                output = self.shell(**kwargs, **({"use_cache": False} | cache))
                if self.is_last and self.router_aux is not None:  # in the forward's context, as the CausalLM's
                    if self._aux_term is None:
                        aux = self.router_aux.term(tuple(routers), attention_mask)
                    elif self.shapes_only:  # garbage logits: counted, they would corrupt a routing pass
                        aux = x.new_zeros((), dtype=torch.float32)
                    else:
                        aux = self._aux_term(tuple(routers), attention_mask)
        finally:
            self._incoming, self._seq, self._carried_in = None, 0, {}
            self._after_forward()
        if self.is_last:
            logits = output.logits if hasattr(output, "logits") else output[0]
            return logits if self.router_aux is None else (logits, aux)
        result, self._outgoing = self._outgoing, None
        carried, self._carried_out = self._carried_out, []
        # sent to the next stage: dense, whatever views the last layer returned
        sent = [result.contiguous(), *(value.contiguous() for value in carried)]
        if routers:
            sent.append(torch.stack(routers))
        return tuple(sent) if len(sent) > 1 else sent[0]

    def _swap_in(self, module, args, kwargs):
        if self._incoming is None:
            return None
        if args:
            return (self._incoming, *args[1:]), {**kwargs, **self._carried_in}
        return args, {**kwargs, "hidden_states": self._incoming, **self._carried_in}

    def _take_out(self, module, args, output):
        if self._seq == 0:
            return None
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        self._outgoing = hidden
        self._carried_out = [_carried_value(module, output, index, keyword) for index, keyword in self.carried]
        # the full sequence's shape: under SP the hidden states are [batch, seq / shards, hidden]; Gemma-3n's
        # hold several streams ([streams, batch, seq, hidden]), whole without SP
        shape = hidden.shape if self.seq_shards == 1 else (hidden.shape[0], self._seq, hidden.shape[-1])
        stand_in = hidden.new_zeros(()).expand(shape)
        return stand_in if isinstance(output, torch.Tensor) else (stand_in, *output[1:])


def _received(value: torch.Tensor, shapes_only: bool) -> torch.Tensor:
    """A carried value as the first layer gets it: floating ones through ``_ContiguousGrad`` (their gradient is
    sent back), integer ones as they are, or zeros while only shapes are learnt (indices must stay in bounds)."""
    if value.is_floating_point():
        return _ContiguousGrad.apply(value)
    return torch.zeros_like(value) if shapes_only else value


def _carried_value(layer: nn.Module, output, index: int, keyword: str) -> torch.Tensor:
    """Entry ``index`` of a layer's ``output``, which the model hands to the next layer as ``keyword``: a tensor,
    or the stage could not send it."""
    value = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"{type(layer).__name__} returned {type(value).__name__} in entry {index} of its output, which the model "
            f"hands to the next layer as {keyword}; pipeline stages hand on tensors only: use pp=1")
    return value


def is_placeholder(module: nn.Module) -> bool:
    """True for a module another stage owns (so no TP layer, SP hook or gradient sum applies to it)."""
    return isinstance(module, (Absent, PassThrough, ZeroContribution, ZeroEmbedding, StandInList))


def dropped(model: nn.Module, name: str) -> bool:
    """True when module ``name`` is absent from this rank: it, or a module containing it, is a placeholder."""
    module = model
    for part in name.split("."):
        module = module._modules.get(part)
        if module is None or is_placeholder(module):
            return True
    return False
