"""The data a training run needs, from its arguments: training blocks, validation blocks, tokenizer.

The trainer's one entry into ``plait.data``; runs before any process group exists, so a bad file fails every
rank at once, never inside a collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plait.config import ConfigError
from plait.data.blocks import dataset_text_file, training_blocks
from plait.data.corpus import default_corpus_path
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


def load_data(args: TrainArgs, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Training blocks, validation blocks (with --validation_file), as [n, block_size] token ids, and the
    tokenizer that made them (None for byte ids), saved with checkpoints."""
    try:
        if args.dataset_name:
            files = [dataset_text_file(Path(args.dataset_name), Path(args.output_dir))]
        else:
            files = [Path(args.train_file) if args.train_file else default_corpus_path()]
        blocks, tokenizer = training_blocks(files, args.block_size, vocab_size, tokenizer_dir(args))
        val_blocks = None
        if args.validation_file:
            val_blocks, _ = training_blocks([Path(args.validation_file)], args.block_size, vocab_size, tokenizer_dir(args))
    except ValueError as err:  # empty file, too few tokens for one block, tokenizer larger than the model
        raise ConfigError(str(err)) from err
    return blocks, val_blocks, tokenizer
