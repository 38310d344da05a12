"""Sharded checkpoints: save at any layout, resume or reshard at any other, consolidate to Hugging Face.

See ``format`` for the on-disk layout. Entry points for the trainer and the CLI:
``save_checkpoint``, ``load_checkpoint``, ``consolidate`` and the rotation helpers.
"""

from plait.checkpoint.consolidate import consolidate
from plait.checkpoint.format import (
    CheckpointError, checkpoint_path, latest_checkpoint, list_checkpoints, rotate_checkpoints, should_save,
)
from plait.checkpoint.load import CheckpointState, load_checkpoint, saved_layout
from plait.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError", "CheckpointState", "checkpoint_path", "consolidate", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "rotate_checkpoints", "save_checkpoint", "saved_layout", "should_save",
]
