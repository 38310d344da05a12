"""The transformers config a run trains, from its flags: a model directory's, a config.json, the checkpoint
resumed from, or plait's tiny Llama.

``plait train``, ``plait plan`` and ``plait prepare-data`` all read it, before any model or process group exists.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from plait.checkpoint.format import model_config as saved_model_config
from plait.checkpoint.format import read_index
from plait.config import ConfigError
from plait.train_args import TrainArgs

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
    return config


def load_config_file(path: Path) -> PretrainedConfig:
    """A transformers config.json, without needing the rest of a model dir."""
    values = json.loads(path.read_text())
    if "model_type" not in values:
        raise ConfigError(f"{path} has no 'model_type'; it must be a transformers config.json")
    return AutoConfig.for_model(values.pop("model_type"), **values)
