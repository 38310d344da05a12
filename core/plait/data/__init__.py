"""Data for plait: a bundled corpus, a trainable tokenizer, packing and sampling.

Everything here is independent of torch.distributed: callers pass their
data-parallel rank and size, and every rank derives the same global batch.
"""

from plait.data.corpus import default_corpus_path
from plait.data.dataset import pack_blocks, tokenize_files
from plait.data.sampler import GlobalBatchSampler, local_microbatch
from plait.data.tokenizer import load_or_train_tokenizer, train_bpe_tokenizer

__all__ = [
    "GlobalBatchSampler",
    "default_corpus_path",
    "load_or_train_tokenizer",
    "local_microbatch",
    "pack_blocks",
    "tokenize_files",
    "train_bpe_tokenizer",
]
