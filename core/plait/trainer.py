"""``plait train``: one training loop for every layout.

The global batch of a step is a function of (seed, step) only (GlobalBatchSampler); each data-parallel
rank takes its contiguous share of each micro-step, and losses are normalised by the global token count,
so any layout with the same global batch trains on the same tokens and, in fp32, follows the same curve.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from plait import comm
from plait.config import ConfigError
from plait.data import GlobalBatchSampler, default_corpus_path, local_microbatch
from plait.data.pipeline import training_blocks
from plait.parallelize import ParallelModel, parallelize
from plait.runtime import init_distributed, is_main_process, pick_device
from plait.train_args import TrainArgs

DEFAULT_MODEL_CONFIG = "tiny-llama.json"


def read_model_config(args: TrainArgs) -> PretrainedConfig:
    """The transformers config: from the model dir, the given config.json, or plait's tiny Llama."""
    if args.model_name_or_path:
        return AutoConfig.from_pretrained(args.model_name_or_path)
    if args.model_config:
        return load_config_file(Path(args.model_config))
    return load_config_file(Path(str(resources.files("plait.configs").joinpath(DEFAULT_MODEL_CONFIG))))


def load_config_file(path: Path) -> PretrainedConfig:
    """A transformers config.json, without needing the rest of a model dir."""
    values = json.loads(path.read_text())
    if "model_type" not in values:
        raise ConfigError(f"{path} has no 'model_type'; it must be a transformers config.json")
    return AutoConfig.for_model(values.pop("model_type"), **values)


def check_model_fits(args: TrainArgs, config: PretrainedConfig) -> None:
    """Model-dependent checks, still before any process group exists."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.block_size > positions:
        raise ConfigError(
            f"--block_size={args.block_size} is larger than the model's max_position_embeddings={positions}; "
            f"use --block_size {positions} or less"
        )
    parallel = args.parallel_config()
    if parallel.sequence_parallel and args.block_size % parallel.tp:
        raise ConfigError(
            f"--block_size={args.block_size} is not divisible by --tensor_parallel_size={parallel.tp} under sequence "
            f"parallelism; use a multiple of {parallel.tp} or --disable_sequence_parallel"
        )


def build_model(args: TrainArgs, config: PretrainedConfig) -> torch.nn.Module:
    """The full model on CPU; the same seed gives the same weights on every rank and for every layout."""
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config)


class MetricsLog:
    """metrics.jsonl, one JSON object per optimizer step, written by rank 0 only."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.enabled = is_main_process()
        if self.enabled:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def train(args: TrainArgs) -> list[dict]:
    """Run the training job described by ``args``; returns the per-step metrics (every rank)."""
    args.validate()
    model_config = read_model_config(args)
    check_model_fits(args, model_config)
    parallel = args.parallel_config()
    device = pick_device(args.device)
    init_distributed(device, args.backend, args.ddp_timeout)
    console = Console(stderr=True, quiet=not is_main_process())

    model = build_model(args, model_config)
    pmodel = parallelize(model, parallel).to(device)
    mesh = pmodel.mesh
    files = [Path(args.train_file)] if args.train_file else [default_corpus_path()]
    tokenizer_dir = Path(args.model_name_or_path) if args.model_name_or_path and _has_tokenizer(args.model_name_or_path) else None
    try:
        blocks, _ = training_blocks(files, args.block_size, model_config.vocab_size, tokenizer_dir)
    except ValueError as err:  # empty file, too few tokens for one block, tokenizer larger than the model
        raise ConfigError(str(err)) from err
    global_batch = args.per_device_train_batch_size * mesh.dp
    sampler = GlobalBatchSampler(len(blocks), global_batch, args.seed)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.learning_rate)
    local_params = sum(p.numel() for p in pmodel.parameters())
    console.print(f"[bold]plait[/] layout {mesh.config.describe()} | adapter {pmodel.adapter.name} "
                  f"({pmodel.adapter.distribution or 'in-process'}) | parameters on rank 0: {local_params:,} | "
                  f"{len(blocks):,} blocks of {args.block_size} tokens, global batch {global_batch}")

    log = MetricsLog(Path(args.output_dir))
    history = []
    num_items = global_batch * (args.block_size - 1)  # packed blocks: every shifted label counts
    progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.description}"),
                        TimeRemainingColumn(), console=console, disable=not is_main_process())
    with progress:
        task = progress.add_task("", total=args.max_steps)
        for step in range(args.max_steps):
            start = time.perf_counter()
            indices = sampler.indices(step)
            batch = blocks[local_microbatch(indices, mesh.dp_rank, mesh.dp, 1, 0)].to(device)
            loss = pmodel(batch, labels=batch, num_items_in_batch=num_items)
            loss.backward()
            pmodel.finish_grad_sync()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            global_loss = comm.all_reduce(loss.detach().clone(), mesh.dp_group).item()
            elapsed = time.perf_counter() - start
            record = {"step": step + 1, "loss": global_loss, "lr": optimizer.param_groups[0]["lr"],
                      "tokens_per_s": global_batch * args.block_size / elapsed}
            history.append(record)
            log.write(record)
            progress.update(task, advance=1, description=f"loss {global_loss:.4f} | {record['tokens_per_s']:,.0f} tok/s")
            if (step + 1) % args.logging_steps == 0 and not console.is_terminal:
                console.print(json.dumps(record), soft_wrap=True)
    return history


def _has_tokenizer(model_dir: str) -> bool:
    return any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
