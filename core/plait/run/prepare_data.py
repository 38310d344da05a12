"""``plait prepare-data``: tokenize a run's data into the cache before the run, and say how big it is.

Takes ``plait train``'s flags (the same flags give the same cache entry, so the run that follows only reads
it) and prints what to know before a long run: documents, tokens, blocks, the global batch, and the epochs
that ``--max_steps`` implies.
"""

from __future__ import annotations

import argparse
import dataclasses

from plait.base.config import ConfigError, data_parallel_size
from plait.run.train_args import TrainArgs, add_arguments, from_namespace


def add_prepare_data_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("prepare-data", parents=parents,
                            help="tokenize a run's data into the cache (plait train's flags) and "
                                                 "print documents, tokens, blocks and epochs")
    add_arguments(parser, TrainArgs)
    parser.add_argument("--world_size", type=int, default=None,
                        help="processes of the run, for the global batch (default: --nproc_per_node, at least "
                             "tp * cp * pp)")
    parser.set_defaults(func=cmd_prepare_data)


def run_data_parallel_size(args: TrainArgs, world_size: int | None) -> int:
    """The run's dp, derived as ``plait train`` derives it (``plait.base.config.data_parallel_size``), for the global
    batch this command prints; the world is --world_size, else --nproc_per_node, else the smallest layout."""
    tp, cp, pp = args.tensor_parallel_size, args.context_parallel_size, args.pipeline_parallel_size
    world = world_size or (args.nproc_per_node if args.nproc_per_node > 1 else tp * cp * pp)
    return data_parallel_size(world, tp, cp, pp)


def cmd_prepare_data(ns: argparse.Namespace) -> None:
    args = from_namespace(ns, TrainArgs)
    if args.train_file and args.dataset_name:
        raise ConfigError("give --train_file or --dataset_name, not both")
    # Every other flag is checked as `plait train` checks it; the data paths by the data layer (globs too).
    dataclasses.replace(args, train_file=None, validation_file=None).validate()
    dp = run_data_parallel_size(args, ns.world_size)

    # Imported when the command runs: every ``plait`` command builds this parser, and these cost seconds.
    from plait.data.sft import SFT_FORMATS, data_format, load_sft_data
    from plait.run.model_config import check_model_fits, read_model_config
    from plait.run.train_data import prepare_data

    model_config = read_model_config(args)
    check_model_fits(args, model_config)  # the blocks must be ones plait train can run
    vocab_size = model_config.vocab_size
    try:  # the data layer's errors name the file and the fix: the command's one line
        fmt = data_format(args.sft_source())
        if fmt == "vision":  # was tokenized as plain text, JSON and all, and reported as prepared
            raise ConfigError("plait prepare-data caches text and SFT data; image-text rows (--data_format vision) "
                              "are encoded by plait train as it reads them, with the model's processor: nothing to "
                              "prepare")
        if fmt in SFT_FORMATS:  # load_sft_data prints examples, tokens, blocks and the cache entry
            lines = batch_lines(args, dp, len(load_sft_data(args.sft_source(), vocab_size).blocks))
        else:
            lines = report(prepare_data(args, vocab_size, local_rank=0, progress=True), args, dp)
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from err
    for line in lines:
        print(line)


def report(data, args: TrainArgs, dp: int) -> list[str]:
    """The lines ``plait prepare-data`` prints."""
    tokenizer = data.tokenizer
    lines = [f"tokenizer: {data.train.encoder.name}"
             + (f", {tokenizer.name_or_path}" if tokenizer is not None and tokenizer.name_or_path else "")]
    for name, cache, meta, blocks in (("train", data.train, data.train_meta, data.blocks),
                                      ("validation", data.validation, data.val_meta, data.val_blocks)):
        if cache is None:
            continue
        rate = meta["input_bytes"] / max(meta["seconds"], 1e-9) / 1e6
        how = (f"tokenized now in {meta['seconds']:.1f} s ({rate:.1f} MB/s)" if name in data.prepared
               else "from the cache")
        lines.append(f"{name}: {meta['input_bytes'] / 1e6:,.1f} MB in {len(cache.sources)} file(s) -> "
                     f"{meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens ({meta['dtype']}), "
                     f"{len(blocks):,} blocks of {args.block_size} tokens; {how}")
        lines.append(f"{name} cache: {cache.path}")
    return lines + batch_lines(args, dp, len(data.blocks))


def batch_lines(args: TrainArgs, dp: int, num_blocks: int) -> list[str]:
    """The global batch and the epochs --max_steps implies."""
    lines = []
    global_batch = args.global_batch(dp)
    lines.append(f"global batch: {global_batch:,} blocks ({args.per_device_train_batch_size} per device x dp {dp} x "
                 f"{args.gradient_accumulation_steps} accumulation steps) = {global_batch * args.block_size:,} tokens "
                 f"per step")
    seen = args.max_steps * global_batch
    lines.append(f"--max_steps {args.max_steps}: {seen:,} blocks = {seen / num_blocks:.3f} epochs of the "
                 f"training data")
    return lines
