"""Every code block in README.md and docs/*.md runs, or says why it cannot.

A fenced block is run by its language: ``python`` blocks of one page run in
order in one subprocess and share one namespace (a page reads like one
session, and the interpreter and imports are paid once per page); ``sh``
blocks run one by one under ``bash -euo pipefail``. Both run in a scratch
directory that links the checkout's ``examples``, so relative paths in the
docs resolve as they do for a reader in the repository root, and nothing a
block writes (``runs/``, checkpoints) lands in the checkout.

A block that cannot run here (a GPU, a Ray cluster, the network, a
long-running server, a command other tooling runs) is marked on the line
just above its fence with ``<!-- not-run: <reason> -->``; the reason is
required. Any other language must be marked too, so nothing is shown that
no one ran. ``docs/architecture.md`` holds no code (``tests/test_docs.py``
checks that page).

The page runs are bounded (``PAGE_TIMEOUT_S``), and a failing block fails
its page's test naming the file and line (python tracebacks carry
``<page>:<line>`` as their file name). The runs are ``model_plane`` tests
(the tiny model, the SDK clients): a light install leaves them out, the
full run (``make test``) runs them. The whole file takes 45-70 s on 2 vCPUs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md")])
RUN_LANGUAGES = ("python", "sh")
PAGE_TIMEOUT_S = 300  # a page's python blocks take 1-15 s here; the bound is for a hang
SH_TIMEOUT_S = 180  # the slowest sh block (two training steps of the copy recipe) takes about 20 s

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(.*?)\s*-->$")


class Block(NamedTuple):
    page: Path
    line: int
    """1-based line of the first code line."""
    language: str
    code: str
    not_run: str | None
    """The reason given, or None for a block that runs."""
    marks: tuple[str, ...] = ()
    """The HTML comments just above the fence (``not-run: ...``, ``fresh:main``, ...)."""


def parse(page: Path) -> list[Block]:
    """The fenced blocks of a markdown page, each with the ``not-run`` reason of the comments just above it."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        marks = []
        j = i - 1
        while j >= 0 and (m := _MARK.match(lines[j].strip())):
            marks.append(m.group(1))
            j -= 1
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.name}:{i + 1}: code block never closed")
        reason = None
        for mark in marks:
            if mark.startswith("not-run"):
                reason = mark.removeprefix("not-run").lstrip(":").strip()
                if not reason:
                    raise AssertionError(f"{page.name}:{i + 1}: 'not-run' needs a reason: <!-- not-run: why -->")
        blocks.append(Block(page, i + 2, opening.group(1), "\n".join(lines[i + 1:end]) + "\n", reason, tuple(marks)))
        i = end + 1
    return blocks


# Runs the blocks of one page in one namespace; each compiled under its page and line, so a
# traceback names where in the docs it failed.
_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for name, line, code in json.load(sys.stdin):
    print(f"--- {name}:{line}", flush=True)
    exec(compile("\\n" * (line - 1) + code, name, "exec"), namespace)
"""


def _scratch(tmp_path: Path) -> Path:
    """A directory to run blocks in, with the checkout's examples linked where the docs expect them."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"  # third-party noise is not the docs' concern
    return env


def run_python(blocks: list[Block], cwd: Path) -> subprocess.CompletedProcess[str]:
    payload = json.dumps([[str(b.page.relative_to(ROOT)) if b.page.is_relative_to(ROOT) else str(b.page),
                           b.line, b.code] for b in blocks])
    return subprocess.run([sys.executable, "-c", _RUNNER], check=False, input=payload, cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)


def run_sh(block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], check=False, cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=SH_TIMEOUT_S)


def _failure(what: str, done: subprocess.CompletedProcess[str]) -> str:
    return f"{what} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"


ALL_BLOCKS = [b for page in PAGES for b in parse(page)]
SH_BLOCKS = [b for b in ALL_BLOCKS if b.language == "sh" and b.not_run is None]
PYTHON_PAGES = sorted({b.page for b in ALL_BLOCKS if b.language == "python" and b.not_run is None})


def test_the_pages_exist() -> None:
    """The docs the README links to are there (a glob over nothing would pass every other test)."""
    names = {p.name for p in PAGES}
    assert {"README.md", "embedding.md", "serving.md", "recipes.md"} <= names, names
    assert len(ALL_BLOCKS) >= 10, [(b.page.name, b.line) for b in ALL_BLOCKS]


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.not_run is None],
                         ids=lambda b: f"{b.page.name}:{b.line}")
def test_every_block_runs_or_says_why_not(block: Block) -> None:
    assert block.language in RUN_LANGUAGES, (
        f"{block.page.name}:{block.line}: a ```{block.language} block is neither run (python, sh) "
        "nor marked <!-- not-run: reason -->")


def test_fresh_machine_blocks_are_left_to_their_tools() -> None:
    """The README's two fresh-machine commands are run by .ci/run and fresh-check, not here."""
    text = (ROOT / "README.md").read_text()
    for marker in ("<!-- fresh:main -->", "<!-- fresh:test -->"):
        assert marker in text, marker
    fresh = [b for b in parse(ROOT / "README.md") if any(m.startswith("fresh:") for m in b.marks)]
    assert sorted(m for b in fresh for m in b.marks if m.startswith("fresh:")) == ["fresh:main", "fresh:test"]
    assert all(b.not_run == "run by .ci/run and fresh-check" for b in fresh), fresh


# The docs run the tiny model, the torch backend and the SDK clients: a light install
# (tests/conftest.py) leaves these two out; the full run has everything and runs them.
@pytest.mark.model_plane
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.name)
def test_python_blocks_of_page(page: Path, tmp_path: Path) -> None:
    blocks = [b for b in ALL_BLOCKS if b.page == page and b.language == "python" and b.not_run is None]
    done = run_python(blocks, _scratch(tmp_path))
    assert done.returncode == 0, _failure(f"python blocks of {page.name}", done)


@pytest.mark.model_plane
@pytest.mark.parametrize("block", SH_BLOCKS, ids=lambda b: f"{b.page.name}:{b.line}")
def test_sh_block(block: Block, tmp_path: Path) -> None:
    done = run_sh(block, _scratch(tmp_path))
    assert done.returncode == 0, _failure(f"{block.page.name}:{block.line}", done)


def test_a_failing_block_fails_and_is_named(tmp_path: Path) -> None:
    """The runner is no rubber stamp: a block that raises fails its page, naming page and line."""
    page = tmp_path / "page.md"
    page.write_text("Intro.\n\n```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is not 2'\n```\n")
    blocks = parse(page)
    assert [b.line for b in blocks] == [4, 8]
    done = run_python(blocks, tmp_path)
    assert done.returncode != 0
    assert f'File "{page}", line 8' in done.stderr and "x is not 2" in done.stderr, done.stderr
    failing_sh = Block(page, 1, "sh", "false\necho never\n", None)
    assert run_sh(failing_sh, tmp_path).returncode != 0


def test_not_run_needs_a_reason(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run -->\n```sh\nnvidia-smi\n```\n")
    with pytest.raises(AssertionError, match="needs a reason"):
        parse(page)
    page.write_text("<!-- not-run: needs a GPU -->\n```sh\nnvidia-smi\n```\n")
    assert parse(page)[0].not_run == "needs a GPU"


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    """A page's links to files of the checkout (other pages, examples, bench results) point at files that exist."""
    missing = [target for target in _LINK.findall(page.read_text())
               if "://" not in target and not (page.parent / target).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
