"""The data a training run needs, from its arguments: training blocks, validation blocks, tokenizer.

The trainer's one entry into ``plait.data``; runs before any process group exists, so a bad file fails every
rank at once, never inside a collective. The text is tokenized once per (corpus, tokenizer) into the token
cache (``plait.data.cache``) by local rank 0 (or beforehand by ``plait prepare-data``); every other local
rank waits for the cache file by polling it, and every rank then reads only the blocks it trains on.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from plait.base.config import ConfigError
from plait.data.blocks import TokenBlocks
from plait.data.cache import TOKENS_FILE, ByteEncoder, TokenCache, TokenizerEncoder
from plait.data.corpus import default_corpus_path
from plait.data.paths import cache_root, tokenizer_dir
from plait.data.sft import SFT_FORMATS, data_format, load_sft_data
from plait.data.sources import Source, dataset_source, resolve_sources
from plait.data.tokenizer import MIN_VOCAB_SIZE, cached_bpe_tokenizer, load_tokenizer
from plait.run.runtime import reports_data
from plait.run.train_args import TrainArgs


def train_sources(args: TrainArgs) -> list[Source]:
    """--dataset_name, else --train_file (file, directory or glob), else the bundled corpus."""
    text_field = getattr(args, "text_field", "text")
    if args.dataset_name:
        return [dataset_source(args.dataset_name, text_field)]
    if args.train_file:
        return resolve_sources(args.train_file, text_field, "--train_file")
    return [Source("txt", default_corpus_path())]


@dataclass
class PreparedData:
    """What ``prepare_data`` made or found: blocks, tokenizer, and the cache entries behind them."""

    blocks: TokenBlocks
    val_blocks: TokenBlocks | None
    tokenizer: Any
    train: TokenCache
    train_meta: dict
    validation: TokenCache | None
    val_meta: dict | None
    prepared: list[str]  # "train" / "validation": tokenized by this call (the rest came from the cache)


def prepare_data(args: TrainArgs, vocab_size: int, local_rank: int = 0, progress: bool = True) -> PreparedData:
    """See ``_prepare_data``; a cache directory that cannot be written is one line naming it and the flag. Plain
    text has no examples to pack, truncate or train on only in part: the SFT flags are refused."""
    args.refuse_unread(("train_on_prompt", "packing", "overlong"),
                       "the SFT flags shape .jsonl chat or prompt_completion examples, and this data is plain "
                       "text, packed into blocks and trained on whole")
    try:
        return _prepare_data(args, vocab_size, local_rank, progress)
    except OSError as err:
        root = cache_root(args.data_cache_dir)
        if err.filename is not None and str(err.filename).startswith(str(root)):
            raise ValueError(f"cannot write the data cache in {root} ({err.strerror or err}); choose a writable "
                             f"directory with enough space with --data_cache_dir") from err
        raise


def _prepare_data(args: TrainArgs, vocab_size: int, local_rank: int, progress: bool) -> PreparedData:
    """Tokenizer, then the token cache of the training (and validation) data, made here on local rank 0 and
    waited for on the other local ranks; then blocks over them.

    Raises:
        ValueError: bad input (empty, binary or unreadable file, a jsonl line without the text field, a
            tokenizer larger than the model's vocabulary, fewer tokens than one block). A failed preparation
            leaves no cache entry behind (nor the BPE it trained for it).
    """
    root, timeout = cache_root(args.data_cache_dir), float(args.ddp_timeout)
    sources = train_sources(args)
    val_sources = (resolve_sources(args.validation_file, getattr(args, "text_field", "text"), "--validation_file")
                   if args.validation_file else None)
    if all(source.kind == "txt" for source in [*sources, *(val_sources or [])]):
        args.refuse_unread(("text_field",), "it names the field of .jsonl lines and the column of Parquet files and "
                           "--dataset_name, and this data is .txt files, read as they are")
    directory, trained_bpe = tokenizer_dir(args.tokenizer_name, args.model_name_or_path), None
    if directory is not None:
        tokenizer = load_tokenizer(directory, vocab_size)
        encoder = TokenizerEncoder(tokenizer)
    elif vocab_size < MIN_VOCAB_SIZE:
        tokenizer, encoder = None, ByteEncoder(vocab_size)
    else:
        tokenizer, bpe_dir, trained = cached_bpe_tokenizer(sources, vocab_size, root / "tokenizers", local_rank,
                                                           timeout)
        trained_bpe = bpe_dir if trained else None
        encoder = TokenizerEncoder(tokenizer)
    try:
        prepared = []
        train = TokenCache(root, sources, encoder)
        train_meta, made = train.ensure(local_rank, timeout, progress=progress)
        prepared += ["train"] * made
        validation = val_meta = val_blocks = None
        if val_sources is not None:
            validation = TokenCache(root, val_sources, encoder)
            val_meta, made = validation.ensure(local_rank, timeout, progress=progress)
            prepared += ["validation"] * made
    except ValueError:
        if trained_bpe is not None:  # trained for data that turned out bad: leave nothing behind
            shutil.rmtree(trained_bpe, ignore_errors=True)
        raise
    blocks = _blocks(train, train_meta, args.block_size)
    if validation is not None:
        val_blocks = _blocks(validation, val_meta, args.block_size)
    return PreparedData(blocks, val_blocks, tokenizer, train, train_meta, validation, val_meta, prepared)


def _blocks(cache: TokenCache, meta: dict, block_size: int) -> TokenBlocks:
    return TokenBlocks(cache.path / TOKENS_FILE, meta["dtype"], block_size, num_tokens=meta["num_tokens"])


def load_data(args: TrainArgs, vocab_size: int) -> tuple[TokenBlocks, TokenBlocks | None, Any]:
    """Training blocks, validation blocks (with --validation_file), as [n, block_size] token ids read from
    the token cache, and the tokenizer that made them (None for byte ids), saved with checkpoints.
    SFT data (--data_format chat / prompt_completion, or detected) gives ``SFTBlocks`` instead
    (``plait.data.sft``)."""
    try:
        fmt = data_format(args.sft_source())  # reads the first source: a bad path fails here
    except (ValueError, OSError) as err:
        raise ConfigError(str(err)) from err
    if fmt in SFT_FORMATS:  # conversations or prompt/completion: padded or packed SFT blocks
        sft = load_sft_data(args.sft_source(), vocab_size, fmt, report=reports_data())
        return sft.blocks, sft.val_blocks, sft.tokenizer
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        data = prepare_data(args, vocab_size, local_rank=local_rank, progress=local_rank == 0)
    except (ValueError, OSError) as err:  # bad file, too few tokens, tokenizer larger than the model, timeout
        raise ConfigError(str(err)) from err
    if reports_data():  # once per node; plait's launcher said it before its workers started
        for name, cache, meta in (("train", data.train, data.train_meta),
                                  ("validation", data.validation, data.val_meta)):
            if cache is not None:
                how = (f"tokenized {meta['input_bytes'] / 1e6:,.1f} MB in {meta['seconds']:.1f} s "
                       f"({meta['input_bytes'] / 1e6 / max(meta['seconds'], 1e-9):.1f} MB/s) into"
                       if name in data.prepared else "read from")
                print(f"{name} data: {meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens, {how} "
                      f"{cache.path}", file=sys.stderr)
    return data.blocks, data.val_blocks, data.tokenizer
