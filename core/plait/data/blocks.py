"""From text files to packed token blocks for a model of a given vocabulary size.

A tokenizer sized to the model (the model dir's own, or a BPE trained on the text) when the vocabulary
can hold one; raw bytes folded into the vocabulary otherwise (tiny test models of a few dozen tokens).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from plait.data.dataset import pack_blocks, tokenize_files
from plait.data.documents import read_documents
from plait.data.tokenizer import MIN_VOCAB_SIZE, load_or_train_tokenizer


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait"


def byte_token_ids(files: list[Path], vocab_size: int) -> torch.LongTensor:
    """Every byte of every document as one id, folded into ``vocab_size`` (for vocabularies under 257)."""
    data = b"".join(doc.encode("utf-8") for path in files for doc in read_documents(path))
    if not data:
        raise ValueError(f"no text in {', '.join(map(str, files))}: the file is empty; give a .txt or .jsonl with text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() % vocab_size


def training_blocks(
    files: list[Path], block_size: int, vocab_size: int, tokenizer_dir: Path | None = None,
    cache_dir: Path | None = None,
) -> tuple[torch.LongTensor, PreTrainedTokenizerBase | None]:
    """[num_blocks, block_size] token ids and the tokenizer that made them (None for bytes)."""
    if tokenizer_dir is None and vocab_size < MIN_VOCAB_SIZE:
        return pack_blocks(byte_token_ids(files, vocab_size), block_size), None
    tokenizer = load_or_train_tokenizer(tokenizer_dir, files, vocab_size, cache_dir or default_cache_dir() / "tokenizers")
    return pack_blocks(tokenize_files(files, tokenizer), block_size), tokenizer


def dataset_text_file(dataset_dir: Path, scratch_dir: Path) -> Path:
    """The 'text' column of a local ``datasets`` dir (``save_to_disk``; its train split if it is a
    DatasetDict) as a .jsonl file, so it goes through the same reader as --train_file."""
    try:
        import datasets
    except ImportError:
        raise ValueError("--dataset_name needs the `datasets` package: pip install datasets") from None
    data = datasets.load_from_disk(str(dataset_dir))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"{dataset_dir} has splits {sorted(data)}, but no 'train' split")
        data = data["train"]
    if "text" not in data.column_names:
        raise ValueError(f"{dataset_dir} has columns {data.column_names}, but no 'text' column")
    scratch_dir.mkdir(parents=True, exist_ok=True)
    path = scratch_dir / f".dataset-{data._fingerprint}.jsonl"
    if not path.exists():
        import json

        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for text in data["text"]:
                f.write(json.dumps({"text": text}) + "\n")
        tmp.replace(path)
    return path
