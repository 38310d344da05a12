"""Turning text files into fixed-size blocks of token ids.

The whole corpus is tokenized once into one stream and cut into equal blocks,
so every training example is full (no padding) and a block index is all that
a sampler needs to hand out.
"""

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from plait.data.documents import read_documents


def tokenize_files(files: list[Path], tokenizer: PreTrainedTokenizerBase) -> torch.LongTensor:
    """Tokenize every document of ``files`` into one 1-D stream of ids.

    Each document (a whole ``.txt`` file, or one ``"text"`` field of a
    ``.jsonl`` line) is followed by the tokenizer's eos token, so the model
    sees where unrelated texts meet once they are packed together.

    Raises:
        ValueError: if the tokenizer has no eos token, or the files hold no text.
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos token to separate documents")
    documents = [document for path in files for document in read_documents(path)]
    if not documents:
        raise ValueError(f"no text to tokenize in {', '.join(str(p) for p in files) or 'an empty file list'}")
    encoded = tokenizer(documents, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    stream: list[int] = []
    for ids in encoded:
        stream.extend(ids)
        stream.append(eos_id)
    return torch.tensor(stream, dtype=torch.long)


def pack_blocks(ids: torch.LongTensor, block_size: int) -> torch.LongTensor:
    """Cut a 1-D id stream into ``[num_blocks, block_size]``, dropping the remainder.

    Raises:
        ValueError: if ``block_size`` is not positive or the stream is shorter
            than one block.
    """
    if ids.dim() != 1:
        raise ValueError(f"expected a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = ids.numel() // block_size
    if num_blocks < 1:
        raise ValueError(f"{ids.numel()} tokens are fewer than one block of block_size={block_size}")
    return ids[: num_blocks * block_size].reshape(num_blocks, block_size)
