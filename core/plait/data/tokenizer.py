"""Byte-level BPE tokenizers trained on the training text itself.

Training a small tokenizer on the corpus lets a tiny model use a small
vocabulary (fast embedding and softmax) without downloading a pretrained
tokenizer. Byte-level BPE has no unknown tokens: any text round-trips.
"""

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from plait.data.documents import read_documents

EOS_TOKEN = "<|endoftext|>"
# Every byte must be a token so that any text can be encoded, plus the special token.
MIN_VOCAB_SIZE = len(pre_tokenizers.ByteLevel.alphabet()) + 1
# Bump when the training recipe changes, so that stale cached tokenizers are not reused.
_RECIPE_VERSION = b"plait-bpe-v1"


def _training_texts(text_files: list[Path]) -> Iterator[str]:
    """Yield the documents line by line so the trainer can count words in parallel."""
    for path in text_files:
        for document in read_documents(path):
            yield from document.splitlines(keepends=True)


def train_bpe_tokenizer(text_files: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with at most ``vocab_size`` tokens.

    ``<|endoftext|>`` is the only special token and serves as eos, bos and pad,
    as in GPT-2. The result is deterministic for the same files and size, so
    every data-parallel rank (or a resumed run) that trains it gets the same ids.

    Raises:
        ValueError: if ``vocab_size`` cannot hold the 256 byte tokens plus the
            special token.
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
    tokenizer.train_from_iterator(_training_texts(text_files), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def _cache_key(text_files: list[Path], vocab_size: int) -> str:
    """Hash the files' contents (in order) and the vocabulary size, not their names or times."""
    digest = hashlib.sha256(_RECIPE_VERSION)
    digest.update(str(vocab_size).encode())
    for path in text_files:
        digest.update(hashlib.sha256(Path(path).read_bytes()).digest())
    return digest.hexdigest()[:24]


def load_or_train_tokenizer(
    tokenizer_dir: Path | None,
    text_files: list[Path],
    vocab_size: int,
    cache_dir: Path,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer in ``tokenizer_dir``, or train one and cache it.

    Without ``tokenizer_dir`` the tokenizer is trained on ``text_files`` and
    saved under ``cache_dir``, keyed by the files' contents and ``vocab_size``,
    so a later call with the same inputs only loads it. The cache entry is
    written to a temporary directory and renamed into place, so a crash or a
    concurrent writer never leaves a half-written tokenizer behind.

    Raises:
        ValueError: if the loaded tokenizer has more tokens than ``vocab_size``
            (its ids would index past the model's embedding), or if
            ``vocab_size`` is too small to train one.
    """
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"tokenizer at {tokenizer_dir} has {len(tokenizer)} tokens, "
                f"more than the model's vocab_size={vocab_size}"
            )
        return tokenizer

    cache_dir = Path(cache_dir)
    target = cache_dir / f"bpe-{vocab_size}-{_cache_key(text_files, vocab_size)}"
    if not target.is_dir():
        trained = train_bpe_tokenizer(text_files, vocab_size)
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir))
        try:
            trained.save_pretrained(staging)
            os.replace(staging, target)
        except OSError:
            # Another process renamed its identical copy into place first.
            if not target.is_dir():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    # Always load from the cache so the first and later calls return the same thing.
    return AutoTokenizer.from_pretrained(target)
