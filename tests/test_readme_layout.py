"""README's "Repository layout" stays true: every path it quotes exists, and every module it names in the core's
stack is a module or package of core/plait (no test reads the README otherwise, and a rename leaves it behind)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Repository layout")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def without_parentheses(text: str) -> str:
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    return text


def test_every_quoted_path_exists():
    paths = re.findall(r"`([\w./<>-]+)`", layout_section())
    assert len(paths) > 10
    for path in paths:
        candidates = [ROOT / path, ROOT / "core" / "plait" / path]
        if "<arch>" in path:  # one per adapter: the folder holding them
            candidates = [ROOT / path.split("<arch>")[0]]
        assert any(c.exists() for c in candidates), f"README's repository layout names {path}, which does not exist"


def test_every_named_core_module_exists():
    stack = without_parentheses(layout_section()).split("`core/plait/`", 1)[1].split("`adapters/<arch>/`", 1)[0]
    names = [name.strip(" `/.:\n") for name in stack.split(":", 1)[1].split(",")]
    assert "run" in names and "cli" in names
    for name in names:
        found = (ROOT / "core" / "plait" / f"{name}.py").exists() or (ROOT / "core" / "plait" / name / "__init__.py").exists()
        assert found, f"README's repository layout names the core module {name!r}, which does not exist"
