"""The transformers config a run trains, from its flags: a model directory's, a config.json, the checkpoint
resumed from, or plait's tiny Llama.

``plait train``, ``plait plan`` and ``plait prepare-data`` all read it, before any model or process group exists.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from plait.base.config import ConfigError
from plait.base.meta import causal_lm_refusal, takes_images
from plait.checkpoint.format import model_config as saved_model_config
from plait.checkpoint.format import read_index
from plait.data.sft_records import data_format
from plait.run.train_args import TrainArgs

DEFAULT_MODEL_CONFIG = "tiny-llama.json"


def read_model_config(args: TrainArgs, resume: Path | None = None) -> PretrainedConfig:
    """The transformers config: from the model dir, the given config.json, the checkpoint resumed from, or
    plait's tiny Llama."""
    if args.model_name_or_path:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    elif args.model_config:
        config = load_config_file(Path(args.model_config))
    elif resume is not None:
        config = saved_model_config(read_index(resume)[1])
    else:
        config = load_config_file(Path(str(resources.files("plait.configs").joinpath(DEFAULT_MODEL_CONFIG))))
    if args.attn_implementation:
        known = ["eager", *ALL_ATTENTION_FUNCTIONS.keys()]
        if args.attn_implementation not in known:
            raise ConfigError(f"--attn_implementation={args.attn_implementation!r} is unknown; choose one of "
                              f"{', '.join(known)}")
        config._attn_implementation = args.attn_implementation
    refuse_non_causal(config)
    return config


def refuse_non_causal(config: PretrainedConfig) -> None:
    """One line, before any model is built, for a model plait cannot train (what ``causal_lm_refusal`` names)."""
    refusal = causal_lm_refusal(config)
    if refusal:
        raise ConfigError(refusal)


def load_config_file(path: Path) -> PretrainedConfig:
    """A transformers config.json, without needing the rest of a model dir."""
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); it must be a transformers config.json") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ConfigError(f"{path} has no 'model_type'; it must be a transformers config.json")
    model_type = values.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{path}: model_type {model_type!r} is not one transformers {transformers.__version__} knows; "
                          f"check the spelling, or upgrade transformers")
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as err:  # noqa: BLE001 (values the config class refuses: its strict validators raise their own kinds)
        why = " ".join(str(err).split())
        raise ConfigError(f"{path}: transformers refuses this {model_type} config: {why}") from None


def check_model_fits(args: TrainArgs, config: PretrainedConfig) -> None:
    """Model-dependent checks, still before any process group exists."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and 0 < positions < args.block_size:  # XLNet's -1: relative positions, no limit
        raise ConfigError(
            f"--block_size={args.block_size} is larger than the model's max_position_embeddings={positions}; "
            f"use --block_size {positions} or less"
        )
    if takes_images(config):
        check_image_text_data(args, config)
    parallel = args.parallel_config()
    if parallel.sequence_parallel and args.block_size % parallel.tp:
        lower = args.block_size - args.block_size % parallel.tp
        nearest = f"{lower} or {lower + parallel.tp}" if lower else f"{parallel.tp}"
        raise ConfigError(  # kept a refusal, not padded: docs/decisions.md D9
            f"--block_size={args.block_size} is not divisible by --tensor_parallel_size={parallel.tp} under sequence "
            f"parallelism; use --block_size {nearest} (a multiple of {parallel.tp}) or --disable_sequence_parallel"
        )


def check_image_text_data(args: TrainArgs, config: PretrainedConfig) -> None:
    """An image-text-to-text model trains by next-token loss on image-text rows (``plait.run.methods.vision_sft``,
    a row without images trained as text turns), by DPO on image-text pairs or by GRPO on image-text prompts; the
    other methods and data formats read a text model's config (an audit's LLaVA with chat rows under ``auto``, a .txt
    file or a text-only method ended in "AttributeError: 'LlavaConfig' object has no attribute 'vocab_size'"): refused
    here in one line instead."""
    name = (config.architectures or [config.model_type])[0]
    if args.method in ("grpo", "dpo"):  # TRL's vision prompt and preference rows (grpo_prompts, preference_images)
        return
    if args.method != "next_token":
        raise ConfigError(f"--method {args.method} with {name}, an image-text model: plait trains an image-text model "
                          f"by next-token loss on image-text rows, by DPO on image-text pairs or by GRPO on image-text "
                          f"prompts; train it without --method, with --data_format vision, or with --method dpo or "
                          f"grpo")
    fmt = data_format(args.sft_source()) if args.train_file else None
    if fmt != "vision":
        what = f"--train_file {args.train_file} was read as {fmt} data" if args.train_file else \
            f"--dataset_name {args.dataset_name} is text" if args.dataset_name else "the built-in corpus is text"
        raise ConfigError(f"{name} is an image-text model, which trains on image-text rows (.jsonl or .parquet: chat "
                          f"'messages', with 'images' where a row has any), but {what}; give such rows with "
                          f"--data_format vision")
