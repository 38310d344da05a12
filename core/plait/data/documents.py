"""Reading whole documents from text files, in memory: the reader of the in-memory reference path
(``plait.data.blocks.training_blocks``, ``tokenize_files``).

Training runs read through the streaming readers of :mod:`plait.data.sources` (the same documents, in
bounded memory; tokenizer training and tokenization both use them, so the tokenizer is trained on exactly
the text it will later encode).
"""

import json
from collections.abc import Iterator
from pathlib import Path


def read_documents(path: Path) -> Iterator[str]:
    """Yield the non-empty documents of one file.

    A ``.jsonl`` file holds one document per line, in the line's ``"text"``
    field; blank lines and null fields are skipped (as the streaming reader
    skips them). Any other file is read whole as a single document, because
    blank lines inside prose and verse are part of its formatting rather than
    document boundaries.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or "text" not in record or not isinstance(record["text"], str | None):
                    raise ValueError(f'{path}:{line_no}: expected a JSON object with a string "text" field')
                if record["text"]:
                    yield record["text"]
    else:
        text = path.read_text(encoding="utf-8")
        if text:
            yield text
