"""The directories a run's data flags name: its tokenizer's and the token cache's root.

Plain text (``train_data``) and SFT data (``sft``) both read them; they live here, below both, so that neither
data path imports the other for them.
"""

from __future__ import annotations

from pathlib import Path

from plait.data.cache import default_cache_root


def tokenizer_dir(tokenizer_name: str | None, model_name_or_path: str | None) -> Path | None:
    """--tokenizer_name, else the model dir's own tokenizer (a pretrained model must see its own tokens)."""
    if tokenizer_name:
        return Path(tokenizer_name)
    if model_name_or_path and any(
        (Path(model_name_or_path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return Path(model_name_or_path)
    return None


def cache_root(data_cache_dir: str | None) -> Path:
    """--data_cache_dir, else ``$XDG_CACHE_HOME/plait`` (``~/.cache/plait``)."""
    return Path(data_cache_dir).expanduser() if data_cache_dir else default_cache_root()
