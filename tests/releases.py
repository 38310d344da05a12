"""What the installed transformers release has, for the tests that name one release's models or code: the suite also
runs on the oldest release pyproject.toml admits (``bash scripts/test.sh --oldest``: transformers 5.23), where a
model type added later is missing and a model rewritten later (CodeGen, Inkling 2, Llama 4's image-text forward) is
the earlier code. Such a test asserts what that release gives, or is skipped naming the release that added it."""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

TRANSFORMERS = Version(Version(transformers.__version__).base_version)


def has_model_type(model_type: str) -> bool:
    return model_type in CONFIG_MAPPING


def needs_model_type(model_type: str, added_in: str) -> pytest.MarkDecorator:
    """Skip where the installed transformers has no ``model_type`` (it joined in ``added_in``)."""
    return pytest.mark.skipif(not has_model_type(model_type),
                              reason=f"transformers {TRANSFORMERS} has no {model_type!r} (added in {added_in})")
