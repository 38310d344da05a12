"""Supervised fine-tuning data: .jsonl conversations (``messages``, or ShareGPT ``conversations``) or
``prompt`` + ``completion`` pairs; their lines are read and checked by ``plait.data.sft_records``.

Conversations are rendered with the tokenizer's own chat template (transformers' ``apply_chat_template``);
the assistant turns are found by rendering the conversation up to each of them (the prefix ending in the
generation prompt, then the prefix including the turn) and mapping those character spans onto tokens with
the fast tokenizer's offsets, so any template works without ``{% generation %}`` markers. Only assistant /
completion tokens are trained on unless ``--train_on_prompt``.

Tokenized examples go through a cache like the text token cache (``plait.data.cache``: one writer per key,
temp dir + rename, others poll): ``tokens.bin`` (ids), ``trainable.bin`` (one byte per token),
``docs.bin`` (end offset and source line per example), ``meta.json``. The key holds the files' identity,
the tokenizer's fingerprint, the chat template, the format and ``--train_on_prompt``; ``--block_size``,
``--packing`` and ``--overlong`` are not in it: blocks are laid out when read (``sft_blocks.lay_out``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.base.config import ConfigError
from plait.base.words import no_effect
from plait.data.cache import CacheEntry, tokenizer_fingerprint
from plait.data.paths import cache_root, tokenizer_dir
from plait.data.sft_blocks import Example, SFTBlocks, describe_counts, lay_out, truncation_warning
from plait.data.sft_records import SFTSource, data_format, read_records
from plait.data.sources import Source, resolve_sources
from plait.data.tokenizer import load_tokenizer

SFT_FORMATS = ("chat", "prompt_completion")
_FIELDS = {"chat": "'messages' or 'conversations' lines", "prompt_completion": "'prompt' + 'completion' lines"}
CACHE_FORMAT = "plait-sft-v1"
TOKENS_FILE, TRAINABLE_FILE, DOCS_FILE, META_FILE = "tokens.bin", "trainable.bin", "docs.bin", "meta.json"


class SFTEncoder:
    """Records of one format -> (ids, trainable) through a transformers tokenizer."""

    def __init__(self, tokenizer, fmt: str, train_on_prompt: bool, where: str = "the tokenizer") -> None:
        if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where} has no chat template, which chat data needs; give --tokenizer_name a "
                             f"tokenizer dir whose tokenizer_config.json sets chat_template, or use "
                             f"prompt/completion data")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{where} is a slow tokenizer; SFT maps turns to tokens by offsets, which needs a fast "
                             f"(tokenizers-backed) one")
        if tokenizer.eos_token_id is None:
            raise ValueError(f"{where} has no eos token to end completions; give a tokenizer with an eos_token")
        self.tokenizer, self.fmt, self.train_on_prompt = tokenizer, fmt, train_on_prompt
        self.key = {"tokenizer": tokenizer_fingerprint(tokenizer), "format": fmt, "train_on_prompt": train_on_prompt,
                    "chat_template": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:24]
                    if fmt == "chat" else None}

    def encode(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        if self.fmt == "chat":
            return self._chat(record["messages"], where)
        tok = self.tokenizer
        prompt = tok(record["prompt"], add_special_tokens=True)["input_ids"]
        completion = tok(record["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = np.asarray(prompt + completion, dtype=np.int64)
        trainable = np.zeros(len(ids), dtype=bool)
        trainable[len(prompt):] = True
        return ids, trainable | self.train_on_prompt

    def _chat(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        render = self.tokenizer.apply_chat_template
        text = render(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            upto = render(messages[: i + 1], tokenize=False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"{where}: the chat template does not render a conversation's beginning as a "
                                 f"prefix of the whole, so assistant turns cannot be located; use a template that "
                                 f"does, or --train_on_prompt")
            spans.append((len(before), len(upto)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int64)
        starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
        trainable = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            trainable |= (starts >= lo) & (starts < hi)
        return ids, trainable | self.train_on_prompt


def _read_meta(entry: Path) -> dict | None:
    try:
        meta = json.loads((entry / META_FILE).read_text())
        ok = (meta.get("format") == CACHE_FORMAT
              and (entry / TOKENS_FILE).stat().st_size == meta["num_tokens"] * 4
              and (entry / TRAINABLE_FILE).stat().st_size == meta["num_tokens"]
              and (entry / DOCS_FILE).stat().st_size == meta["num_documents"] * 16)
        return meta if ok else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


class SFTCache(CacheEntry):
    """The cache entry of ``sources`` encoded by ``encoder`` under ``root``/sft."""

    kind, what = "sft", "the tokenized SFT data"

    def __init__(self, root: Path, sources: list[Source], encoder: SFTEncoder) -> None:
        self.encoder = encoder
        super().__init__(root, sources, {"format": CACHE_FORMAT, "sources": [s.identity() for s in sources],
                                         **encoder.key})

    def read_meta(self) -> dict | None:
        return _read_meta(self.path)

    def _write(self, tmp: Path) -> dict:
        start, ids, flags, docs = time.perf_counter(), [], [], []
        total = 0
        for index, source in enumerate(self.sources):
            if source.kind != "jsonl":
                raise ValueError(f"{source.path}: SFT data must be .jsonl files (got {source.kind})")
            for number, record in read_records(source.path, self.encoder.fmt):
                doc_ids, trainable = self.encoder.encode(record, f"{source.path} line {number}")
                ids.append(doc_ids.astype("<i4"))
                flags.append(trainable.astype(np.uint8))
                total += len(doc_ids)
                docs.append((total, index, number))
        if not docs:
            raise ValueError(f"{self.sources[0].path}: no examples (every line is blank)")
        (tmp / TOKENS_FILE).write_bytes(np.concatenate(ids).tobytes())
        (tmp / TRAINABLE_FILE).write_bytes(np.concatenate(flags).tobytes())
        ends = np.asarray([[end, (index << 40) | number] for end, index, number in docs], dtype="<u8")
        (tmp / DOCS_FILE).write_bytes(ends.tobytes())
        return {"format": CACHE_FORMAT, "num_tokens": total, "num_documents": len(docs),
                "num_trainable": int(sum(int(f.sum()) for f in flags)),
                "seconds": round(time.perf_counter() - start, 3), "key": self.key_fields}

    def examples(self) -> list[Example]:
        """Every cached example, in input order, with the file and line it came from."""
        ids = np.fromfile(self.path / TOKENS_FILE, dtype="<i4")
        trainable = np.fromfile(self.path / TRAINABLE_FILE, dtype=np.uint8).astype(bool)
        docs = np.fromfile(self.path / DOCS_FILE, dtype="<u8").reshape(-1, 2)
        out, start = [], 0
        for end, where in docs.tolist():
            path = self.sources[where >> 40].path
            out.append(Example(ids[start:end], trainable[start:end], f"{path} line {where & ((1 << 40) - 1)}"))
            start = end
        return out


@dataclass
class SFTData:
    """What ``load_sft_data`` returns: blocks for training (and validation) and the tokenizer."""

    blocks: SFTBlocks
    val_blocks: SFTBlocks | None
    tokenizer: Any


def load_sft_data(source: SFTSource, vocab_size: int, fmt: str | None = None, report: bool = True) -> SFTData:
    """SFT blocks from ``source`` (the flags --train_file, --validation_file, --tokenizer_name or the model dir's
    tokenizer, --data_format, --train_on_prompt, --block_size, --packing, --overlong, --data_cache_dir); before any
    process group, so a bad line fails every rank at once (ConfigError naming the file and line). ``report``: say
    what was read (local rank 0 of a node; the run layer knows whether a launcher said it already)."""
    fmt = fmt or data_format(source)
    if source.text_field != SFTSource.text_field:
        raise ConfigError(no_effect(["--text_field"], f": it names the field of plain-text .jsonl lines and the "
                                                      f"column of Parquet files and --dataset_name, and this data is "
                                                      f"{fmt} ({_FIELDS[fmt]})"))
    directory = tokenizer_dir(source.tokenizer_name, source.model_name_or_path)
    if directory is None:
        raise ConfigError(f"--data_format {fmt} needs a tokenizer (with a chat template for chat data); give "
                          f"--tokenizer_name DIR or a --model_name_or_path dir holding one")
    if source.dataset_name or not source.train_file:
        raise ConfigError(f"--data_format {fmt} reads .jsonl files: give --train_file")
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        tokenizer = load_tokenizer(directory, vocab_size)
        encoder = SFTEncoder(tokenizer, fmt, source.train_on_prompt, f"the tokenizer at {directory}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        sets = []
        for name, spec, flag in (("train", source.train_file, "--train_file"),
                                 ("validation", source.validation_file, "--validation_file")):
            if spec is None:
                sets.append(None)
                continue
            cache = SFTCache(cache_root(source.data_cache_dir), resolve_sources(spec, source.text_field, flag), encoder)
            meta, made = cache.ensure(local_rank, float(source.ddp_timeout))
            blocks = lay_out(cache.examples(), source.block_size, pad_id, source.packing, source.overlong)
            if blocks.counts.trainable_kept == 0:
                raise ValueError(f"{spec}: no example has a token left to train on after --block_size="
                                 f"{source.block_size} truncation (the longest has {blocks.counts.longest:,} tokens); "
                                 f"raise --block_size")
            if local_rank == 0 and report:
                print(f"{name} data ({fmt}): {describe_counts(blocks.counts, source.block_size)}; "
                      f"{blocks.real_tokens:,} tokens in {len(blocks):,} {'packed' if source.packing else 'padded'} "
                      f"blocks of {source.block_size} ({blocks.pad_tokens:,} padding), "
                      f"{'tokenized into' if made else 'read from'} {cache.path}", file=sys.stderr)
                warning = truncation_warning(blocks.counts, source.block_size)
                if warning:
                    print(warning, file=sys.stderr)
            sets.append(blocks)
    except OSError as err:
        raise ConfigError(f"SFT data: {err}") from err
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return SFTData(sets[0], sets[1], tokenizer)
