"""What an adapter declares: what an architecture is (``AdapterInfo``, ``Capabilities``) and how its modules
parallelize (``PipelinePlan`` here; ``TPPlan`` and ``SPPlan`` in ``plait.tp.plans``, beside the tensor-parallel
styles they hold), the data its hooks return.

Declarations are plain frozen dataclasses; adapters import them from ``plait`` (``plait.TPPlan``). Adapters build
them from a model config and never touch torch.distributed; the core validates them against the model and
resolves them into the ``LayoutPlan`` (``plait.layout_plan``), which ``parallelize`` applies in one fixed order.
Module names are dotted paths as in ``model.named_modules()``; ``*`` matches exactly one path component
(``model.layers.*.mlp.up_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class Capabilities:
    """What the adapter has been proven to support; the core refuses other combinations before loading."""

    tp: bool = True
    sp: bool = True
    pp: bool = True
    vpp: bool = True
    tied_embeddings: bool = True

    def supported(self) -> list[str]:
        return [name for name, on in vars(self).items() if on]


@dataclass(frozen=True)
class AdapterInfo:
    """Returned by ``plait_adapter_info``: the name, the transformers ``model_type`` values (or model class
    names) the adapter claims, and its capabilities.

    ``generic``: the adapter derives its plans from what transformers declares for any model instead of
    claiming fixed architectures (``architectures`` is then empty). The registry asks it, through
    ``plait_refusal``, only for architectures no explicit adapter claims: an explicit adapter always wins.
    """

    name: str
    architectures: tuple[str, ...]
    capabilities: Capabilities = field(default_factory=Capabilities)
    generic: bool = False


@dataclass(frozen=True)
class PipelinePlan:
    """Returned by ``plait_pipeline_plan``: ``first`` modules run on the first stage (embeddings),
    ``layers`` is the container of repeated blocks split across stages, ``last`` modules run on the last
    stage (final norm, head); ``neutralize`` modules are replaced by no-ops on stages that do not own them
    (e.g. GPT2 position embeddings and embedding dropout): an ``nn.Embedding`` adds zero, anything else
    passes its input through. Parameter-free ``first``/``last`` modules (rotary tables) are not owned by
    one stage: every stage recomputes them. ``layer_outputs``: how many values each layer returns where the
    model unpacks them (Bamba's ``hidden_states, attn_weights = layer(...)``), so that the stand-ins for another
    stage's layers return as many from the first forward on; 0 where the model takes one value or indexes it.
    ``none_outputs``: which of those the model hands to the next layer, a cache that is None without
    ``use_cache`` (RWKV's ``state``); a stage's layers returning anything else there is an error.

    ``every_stage``: modules of ``first`` with parameters whose output goes to the layers beside the hidden
    states (Gemma's per-layer embeddings, CPM-Ant's position bias), and those whose output they read (Gemma's
    input embedding). They run before any layer, so on the batch alone: every stage holds them and computes
    them as the first does, and their gradients (each stage's for its own layers) are summed over the
    pipeline. ``token_ids``: stages after the first run the model on the token ids too (every rank reads the
    same batch), not on a stand-in for the embeddings: ``every_stage`` modules or the layers read them
    (DeepSeek-V4's hash routing). An input embedding not in ``every_stage`` then returns zeros there.

    ``carried``: (index in a layer's return, keyword of the next layer's call) of each value the model hands
    from layer to layer beside the hidden states (GLM-MoE-DSA's top-k indices, ``prev_topk_indices``): a stage
    sends its last layer's beside its hidden states, and the next stage's first layer gets it under that keyword.

    ``first_params``: parameters of the modules holding the layers (not of a module of their own) that only the first
    stage reads, before the layers: LLaVA-NeXT's ``image_newline``, read while the images are merged. The first
    stage holds them; the others drop them."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    neutralize: tuple[str, ...] = ()
    layer_outputs: int = 0
    none_outputs: tuple[int, ...] = ()
    every_stage: tuple[str, ...] = ()
    token_ids: bool = False
    carried: tuple[tuple[int, str], ...] = ()
    first_params: tuple[str, ...] = ()
