"""What the ``rlengine`` commands show beside their own output: help text from docstrings, and
third-party logs kept down.

``plain`` turns docstring markup (````name````) into the plain text a terminal shows;
``setting_docs`` gives each field of a settings Struct its one-line description, the first
sentence of the field's docstring (what ``rlengine train --list`` prints).

``quiet_third_party`` keeps vLLM's, transformers' and torch's start-up chatter (about 40 log
lines and loading bars per run) off the screen, or routes it to stderr with ``verbose``. It
sets process environment variables, which only a command may do to its own process: a
library imported into someone's program must not, so nothing calls it at import. The
commands call it first thing, before torch, transformers or vLLM are imported, since each
reads its variables when it loads.

Standard library only; this module prints nothing itself.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import os
import re
import textwrap

__all__ = ["plain", "quiet_third_party", "setting_docs"]

_MARKUP = re.compile(r"``(.+?)``", re.DOTALL)


def plain(text: str) -> str:
    """``text`` without docstring markup: ````name```` -> ``name``."""
    return _MARKUP.sub(r"\1", text)


def _first_sentence(doc: str) -> str:
    """The first sentence of a docstring, on one line, as plain text."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    # The settings' docstrings put no ". " inside a name or a number: it ends a sentence.
    head, sep, _ = paragraph.partition(". ")
    return plain(head + ("." if sep else ""))


@functools.cache
def setting_docs(cls: type) -> dict[str, str]:
    """Each field of ``cls`` (a msgspec Struct or dataclass written with attribute docstrings)
    that has a docstring -> its first sentence as plain text. Fields are found in the class's
    source (``inspect.getsource``); a class without source gives ``{}``."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            out[node.target.id] = _first_sentence(after.value.value)
    return out


_QUIET = {
    # vLLM logs INFO and WARNING lines on stdout while it starts (about 40 per engine).
    "VLLM_LOGGING_LEVEL": "ERROR",
    # transformers' warnings (a tokenizer's "longer than the specified maximum sequence
    # length" on a long conversation) and its progress bars.
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # torch's Python loggers ("Triton not available") and its C++ warnings (NUMA binding).
    "TORCH_LOGS": "-torch",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    # Every tqdm bar that does not say otherwise (tqdm reads TQDM_* when it is imported; a
    # bar created with an explicit ``disable=``, like the train command's own, keeps it).
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def quiet_third_party(verbose: bool = False) -> None:
    """Set the process's third-party log levels for a command (see the module docstring).

    Quiet (the default): errors only, no loading bars. ``verbose``: everything, on stderr, so
    that stdout keeps only the command's own lines. A variable the user set is left as it is."""
    # vLLM's lines go to stderr either way: a command's stdout is its own output.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if verbose:
        return
    for name, value in _QUIET.items():
        os.environ.setdefault(name, value)
