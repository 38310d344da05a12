"""Location of the corpus bundled with plait.

A small public-domain corpus ships inside the package so that training runs,
examples and tests never need a network connection (see corpus/SOURCE.md).
"""

from pathlib import Path

_CORPUS_DIR = Path(__file__).resolve().parent / "corpus"


def default_corpus_path() -> Path:
    """Return the bundled English text file (~1.5 MB of Shakespeare).

    It is one ``.txt`` file, so callers can pass ``[default_corpus_path()]``
    straight to :func:`plait.data.train_bpe_tokenizer` or
    :func:`plait.data.tokenize_files`.
    """
    return _CORPUS_DIR / "shakespeare.txt"
