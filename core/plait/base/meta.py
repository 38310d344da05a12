"""Models on the meta device: a transformers model's structure and shapes without its memory.

Used to build a model no rank holds whole (``plait.checkpoint.materialize``, like optimum-neuron's
``lazy_load_for_parallelism`` and NxD's meta init) and to know a config's parameter names and shapes
without allocating them (``plait consolidate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Every tensor created inside is a meta tensor."""
    with torch.device("meta"):
        yield


def causal_lm_refusal(config: PretrainedConfig) -> str | None:
    """Why ``config`` cannot be a decoder-only transformers causal LM or image-text-to-text model (None: it can), in
    one line: an encoder-decoder model, an encoder-only one (BERT and its kin, which transformers maps to a masked
    LM: its causal-LM head runs only with is_decoder=true), or a type neither AutoModelForCausalLM nor
    AutoModelForImageTextToText builds. The trainer's check and the generic adapter's refusals both ask here."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if getattr(config, "is_encoder_decoder", False) or getattr(config_class, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model; plait trains decoder-only causal LMs"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return (f"{model_type} is an encoder-only model (its causal-LM head runs only with is_decoder=true in the "
                f"config); plait trains decoder-only causal LMs")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not register_text_causal_lm(model_type) and \
            not takes_images(config):
        return (f"transformers has no causal-LM or image-text-to-text class for {model_type!r} "
                f"(AutoModelForCausalLM and AutoModelForImageTextToText do not build it); plait trains decoder-only "
                f"causal LMs and image-text-to-text models")
    return None


def takes_images(config: PretrainedConfig) -> bool:
    """Whether ``config``'s model is built as an image-text-to-text model (``model_class``): its type is one
    AutoModelForImageTextToText builds, and either AutoModelForCausalLM does not build it or the config names an
    image-text-to-text class in ``architectures`` (a checkpoint of Llama 4's or Qwen 3.5's whole model, where
    AutoModelForCausalLM would build the text decoder alone)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = config.model_type
    if model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return False
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return True
    named = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    return named != MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] and named in (config.architectures or ())


def image_text_model(model: nn.Module) -> bool:
    """Whether ``model`` is built as one of transformers' image-text-to-text classes (a vision tower beside the
    language model ``get_decoder`` gives), whichever Auto class built it (Gemma 3's is also its causal LM), and
    after ZeRO-2/3 made it a subclass of its own (FSDP2's ``FSDP<class>``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    names = set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())
    return any(cls.__name__ in names for cls in type(model).__mro__)


def language_model_name(model: nn.Module) -> str | None:
    """The module name of an image-text model's language model (transformers' ``get_decoder``); None for a text
    model."""
    if not image_text_model(model):
        return None
    decoder = model.get_decoder()
    return next((name for name, module in model.named_modules() if module is decoder), None)


def before_language_model(model: nn.Module) -> Callable[[str], bool]:
    """Whether a module of ``model`` runs on the images before its language model (an image-text model's vision
    tower and projector: outside ``get_decoder`` and not the head); never for a text model."""
    decoder = language_model_name(model)
    if decoder is None:
        return lambda name: False
    head = model.get_output_embeddings()
    head_name = next((name for name, m in model.named_modules() if m is head), None) if head is not None else None
    return lambda name: not (name == decoder or name.startswith(decoder + ".") or name == head_name)


def model_class(config: PretrainedConfig) -> type:
    """transformers' Auto class that builds ``config``'s model: AutoModelForImageTextToText where it takes images
    (``takes_images``), else AutoModelForCausalLM."""
    return AutoModelForImageTextToText if takes_images(config) else AutoModelForCausalLM


def register_text_causal_lm(model_type: str) -> bool:
    """Whether ``model_type`` is a text config whose causal-LM class transformers maps only under its composite's
    type, registered with AutoModelForCausalLM if so. AutoModelForCausalLM maps 'emu3' (and 'mllama') to
    Emu3ForCausalLM, a text-only decoder that takes the composite's text config ('emu3_text_model'): the model it
    builds, and every checkpoint of it, carries the text config, which AutoModelForCausalLM cannot build again
    (from_config, or from_pretrained of a consolidated checkpoint) unless the pair is registered."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in CONFIG_MAPPING:
        return False
    text_config = CONFIG_MAPPING[model_type]
    module = model_type_to_module_name(model_type)
    for composite in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type_to_module_name(composite) != module or composite not in CONFIG_MAPPING:
            continue
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[composite]]
        if CONFIG_MAPPING[composite].sub_configs.get("text_config") is text_config is model_class.config_class:
            AutoModelForCausalLM.register(text_config, model_class, exist_ok=True)
            return True
    return False


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers model of ``config`` on the meta device: its causal LM (a composite's text config too:
    ``register_text_causal_lm``) or its image-text-to-text model (``model_class``)."""
    register_text_causal_lm(config.model_type)
    with meta_init():
        return model_class(config).from_config(config, dtype=dtype)
