"""docs/architecture.md stays true: every file and directory it cites exists, and every ``file: name``
it cites is defined in that file (a walk through code that moved would fail here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _cited() -> tuple[set[str], set[tuple[str, str]]]:
    # A citation may wrap across lines inside its backticks.
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    paths = set(re.findall(r"`(rlengine/[\w/.]*)", text))
    names = set(re.findall(r"`(rlengine/[\w/]+\.py): (\w+)`", text))
    return paths, names


def test_every_cited_path_exists():
    paths, _ = _cited()
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert missing == [], missing


def test_every_cited_name_is_defined_where_the_page_says():
    _, names = _cited()
    assert len(names) > 15
    missing = []
    for path, name in sorted(names):
        source = (ROOT / path).read_text(encoding="utf-8")
        if not re.search(rf"^\s*(?:async def|def|class) {name}\b|^{name}\s*[:=]", source, re.MULTILINE):
            missing.append(f"{path}: {name}")
    assert missing == [], missing
