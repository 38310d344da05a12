"""The flags of ``plait train``: one dataclass, so the command line and a config file share their names.

Names follow Hugging Face / optimum-neuron training scripts so existing launch scripts read naturally.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path

from plait.config import ConfigError, ParallelConfig


@dataclass
class TrainArgs:
    model_config: str | None = field(default=None, metadata={"help": "transformers config.json: random init"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "a local Hugging Face model dir"})
    train_file: str | None = field(default=None, metadata={"help": ".txt or .jsonl ('text' field); default: bundled corpus"})
    output_dir: str = field(default="runs/plait", metadata={"help": "metrics.jsonl (and later checkpoints) go here"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "tp: ranks that split each layer"})
    disable_sequence_parallel: bool = field(default=False, metadata={"help": "keep activations between TP regions whole"})
    disable_embedding_parallelization: bool = field(default=False, metadata={"help": "keep embeddings and LM head replicated"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "sequences per data-parallel rank per micro-step"})
    block_size: int = field(default=128, metadata={"help": "tokens per sequence"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    seed: int = field(default=0, metadata={"help": "the same seed gives the same weights and data for every layout"})
    logging_steps: int = field(default=1, metadata={"help": "print a log line every N steps (metrics.jsonl gets every step)"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available, else cpu), cpu, cuda, or any torch device type"})
    backend: str = field(default="auto", metadata={"help": "torch.distributed backend: auto (nccl on cuda, else gloo), gloo, nccl, xla"})
    ddp_timeout: int = field(default=600, metadata={"help": "seconds a collective may wait before the job fails"})

    def validate(self) -> None:
        """Checks that need no model: fail before any process group or file exists."""
        if self.model_config and self.model_name_or_path:
            raise ConfigError("give --model_config (random init) or --model_name_or_path (load weights), not both")
        for path_flag in ("model_config", "model_name_or_path", "train_file"):
            value = getattr(self, path_flag)
            if value is not None and not Path(value).exists():
                raise ConfigError(f"--{path_flag} {value!r} does not exist")
        for name in ("per_device_train_batch_size", "block_size", "max_steps", "logging_steps", "ddp_timeout"):
            value = getattr(self, name)
            if value < (0 if name == "max_steps" else 1):
                raise ConfigError(f"--{name}={value} must be {'>= 0' if name == 'max_steps' else 'positive'}")
        if not self.learning_rate > 0:
            raise ConfigError(f"--learning_rate={self.learning_rate} must be positive")

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tp=self.tensor_parallel_size,
            sp=not self.disable_sequence_parallel,
            disable_embedding_parallelization=self.disable_embedding_parallelization,
        )


def add_arguments(parser: argparse.ArgumentParser, cls: type = TrainArgs) -> None:
    """One ``--name`` flag per dataclass field; booleans are switches."""
    for f in fields(cls):
        help_text = f.metadata.get("help", "")
        if f.type in (bool, "bool"):
            parser.add_argument(f"--{f.name}", action="store_true", help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f"{help_text} (default: {f.default})")


def from_namespace(ns: argparse.Namespace, cls: type = TrainArgs):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
