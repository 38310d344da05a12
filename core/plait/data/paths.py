"""The directories a run's data flags name: its tokenizer's and the token cache's root.

Plain text (``train_data``) and SFT data (``sft``) both read them; they live here, below both, so that neither
data path imports the other for them.
"""

from __future__ import annotations

from pathlib import Path

from plait.data.cache import default_cache_root
from plait.train_args import TrainArgs


def tokenizer_dir(args: TrainArgs) -> Path | None:
    """--tokenizer_name, else the model dir's own tokenizer (a pretrained model must see its own tokens)."""
    if args.tokenizer_name:
        return Path(args.tokenizer_name)
    if args.model_name_or_path and any(
        (Path(args.model_name_or_path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return Path(args.model_name_or_path)
    return None


def cache_root(args: TrainArgs) -> Path:
    """--data_cache_dir, else ``$XDG_CACHE_HOME/plait`` (``~/.cache/plait``)."""
    return Path(args.data_cache_dir).expanduser() if getattr(args, "data_cache_dir", None) else default_cache_root()
