"""Data for plait: a bundled corpus, a trainable tokenizer, a token cache on disk, packing and sampling.

Everything here is independent of torch.distributed: callers pass their
data-parallel rank and size, and every rank derives the same global batch.
"""

from plait.base.batches import local_microbatch
from plait.data.blocks import TokenBlocks
from plait.data.cache import TokenCache
from plait.data.corpus import default_corpus_path
from plait.data.dataset import pack_blocks, tokenize_files
from plait.data.sampler import GlobalBatchSampler
from plait.data.sources import resolve_sources
from plait.data.tokenizer import load_or_train_tokenizer, train_bpe_tokenizer

__all__ = [
    "GlobalBatchSampler",
    "TokenBlocks",
    "TokenCache",
    "default_corpus_path",
    "load_or_train_tokenizer",
    "local_microbatch",
    "pack_blocks",
    "resolve_sources",
    "tokenize_files",
    "train_bpe_tokenizer",
]
