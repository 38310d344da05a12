"""Byte-level BPE tokenizers trained on the training text itself.

Training a small tokenizer on the corpus lets a tiny model use a small
vocabulary (fast embedding and softmax) without downloading a pretrained
tokenizer. Byte-level BPE has no unknown tokens: any text round-trips.

The tokenizer is trained on a bounded sample of the corpus, ``BPE_SAMPLE_CHARS`` (32 Mi characters) taken
from the start of each input file in proportion to its size (the whole corpus when it is smaller), so its
cost and memory do not grow with the corpus. It is cached under ``<cache root>/tokenizers/``, keyed by the
files' identity (path, size, mtime), the vocabulary size, the sample size and the recipe version.
"""

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from plait.data.cache import _host, _stale_temporaries, empty_message, exclusive, publish, wait_for
from plait.data.sources import Source, resolve_sources, sample_lines

EOS_TOKEN = "<|endoftext|>"
# Every byte must be a token so that any text can be encoded, plus the special token.
MIN_VOCAB_SIZE = len(pre_tokenizers.ByteLevel.alphabet()) + 1
# Bump when the training recipe changes, so that stale cached tokenizers are not reused.
_RECIPE_VERSION = b"plait-bpe-v2"
# Characters of text the BPE is trained on at most (see the module doc).
BPE_SAMPLE_CHARS = 32 << 20


def as_sources(files: Iterable) -> list[Source]:
    """Paths (files, directories, globs) or sources, as sources."""
    out: list[Source] = []
    for f in files:
        out.extend([f] if isinstance(f, Source) else resolve_sources(f))
    return out


class EmptySample(ValueError):
    """The corpus has no text to train a tokenizer on."""


def _training_texts(sources: list[Source], sample_chars: int, seen: list[int]) -> Iterator[str]:
    """The sample's lines (so the trainer can count words in parallel); counts characters into ``seen``."""
    for line in sample_lines(sources, sample_chars):
        seen[0] += len(line)
        yield line


def train_bpe_tokenizer(text_files: list, vocab_size: int, sample_chars: int | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with at most ``vocab_size`` tokens on a sample of at most
    ``sample_chars`` characters of ``text_files`` (paths or sources).

    ``<|endoftext|>`` is the only special token and serves as eos, bos and pad,
    as in GPT-2. The result is deterministic for the same files and size, so
    every data-parallel rank (or a resumed run) that trains it gets the same ids.

    Raises:
        ValueError: if ``vocab_size`` cannot hold the 256 byte tokens plus the
            special token, or the files hold no text.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE tokenizer: "
            f"the minimum is {MIN_VOCAB_SIZE} (256 byte tokens + {EOS_TOKEN})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sources = as_sources(text_files)
    sample_chars = BPE_SAMPLE_CHARS if sample_chars is None else sample_chars
    seen = [0]
    tokenizer.train_from_iterator(_training_texts(sources, sample_chars, seen), trainer=trainer)
    if not seen[0]:
        raise EmptySample(empty_message(sources))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def _cache_key(sources: list[Source], vocab_size: int, sample_chars: int) -> str:
    """Hash the files' identity (path, size, mtime: a changed file is a new key), the vocabulary size and
    the sample size; computed without reading the files, so waiting ranks know the entry to wait for."""
    digest = hashlib.sha256(_RECIPE_VERSION)
    digest.update(json.dumps([vocab_size, sample_chars, [s.identity() for s in sources]]).encode())
    return digest.hexdigest()[:24]


def bpe_cache_path(text_files: list, vocab_size: int, cache_dir: Path, sample_chars: int | None = None) -> Path:
    sample_chars = BPE_SAMPLE_CHARS if sample_chars is None else sample_chars
    return Path(cache_dir) / f"bpe-{vocab_size}-{_cache_key(as_sources(text_files), vocab_size, sample_chars)}"


def cached_bpe_tokenizer(
    text_files: list, vocab_size: int, cache_dir: Path, local_rank: int = 0, timeout: float = 600.0,
    sample_chars: int | None = None,
) -> tuple[PreTrainedTokenizerBase, Path, bool]:
    """The BPE for ``text_files`` from the cache, trained first (local rank 0) if missing; other local ranks
    wait for it. Returns (tokenizer, its cache dir, trained by this call)."""
    sources = as_sources(text_files)
    sample_chars = BPE_SAMPLE_CHARS if sample_chars is None else sample_chars
    target = bpe_cache_path(sources, vocab_size, cache_dir, sample_chars)
    trained = False
    if not target.is_dir():
        if local_rank != 0:
            wait_for(target, target.is_dir, timeout, "the tokenizer")
        else:
            with exclusive(target, target.is_dir, timeout, "the tokenizer") as mine:
                if mine:
                    tokenizer = train_bpe_tokenizer(sources, vocab_size, sample_chars)
                    for stale in _stale_temporaries(target):  # left by a killed trainer
                        shutil.rmtree(stale, ignore_errors=True)
                    staging = target.parent / f".{target.name}.tmp-{_host()}-{os.getpid()}"
                    shutil.rmtree(staging, ignore_errors=True)
                    try:
                        tokenizer.save_pretrained(staging)
                        publish(staging, target)
                    finally:
                        shutil.rmtree(staging, ignore_errors=True)
                    trained = True
    # Always load from the cache so the first and later calls return the same thing.
    return AutoTokenizer.from_pretrained(target), target, trained


def load_tokenizer(tokenizer_dir: Path, vocab_size: int) -> PreTrainedTokenizerBase:
    """A tokenizer dir's tokenizer, refused if its ids would index past the model's embedding."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as err:  # transformers' many-line "cannot load": its first line names the cause
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ValueError(f"no tokenizer transformers can load in {tokenizer_dir} ({first}); give a directory "
                         f"holding tokenizer.json or tokenizer_config.json (--tokenizer_name)") from None
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer at {tokenizer_dir} has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size={vocab_size}; use a model with vocab_size >= {len(tokenizer)} or a smaller --tokenizer_name"
        )
    return tokenizer


def load_or_train_tokenizer(
    tokenizer_dir: Path | None,
    text_files: list,
    vocab_size: int,
    cache_dir: Path,
    local_rank: int = 0,
    timeout: float = 600.0,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer in ``tokenizer_dir``, or train one and cache it.

    Without ``tokenizer_dir`` the tokenizer is trained on a bounded sample of ``text_files`` and
    saved under ``cache_dir``, keyed by the files' identity and ``vocab_size``,
    so a later call with the same inputs only loads it. The cache entry is
    written to a temporary directory and renamed into place, so a crash or a
    concurrent writer never leaves a half-written tokenizer behind; only local rank 0 trains.

    Raises:
        ValueError: if the loaded tokenizer has more tokens than ``vocab_size``
            (its ids would index past the model's embedding), or if
            ``vocab_size`` is too small to train one.
    """
    if tokenizer_dir is not None:
        return load_tokenizer(tokenizer_dir, vocab_size)
    return cached_bpe_tokenizer(text_files, vocab_size, cache_dir, local_rank, timeout)[0]
