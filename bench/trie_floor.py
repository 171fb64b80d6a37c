"""Build and run csrc/trie_floor.c, the memory floor of the token-trie workload.

The driver runs bench/test_trie.py's workload in C alone and reports what
the C trie costs without Python, and what any store holding the same data
must spend reading and writing it (see the driver's header). The floor is
what the trie's cold figures are held to: a ratio target above
``baseline / floor`` cannot be met by any implementation on that machine.

    exe = build(tmp_dir)
    figures = run(exe, sessions=2000, turns=8, ...)

``python bench/trie_floor.py`` (or ``make floor``) builds it into build/ and
runs it once on bench/test_trie.py's workload.

Needs a C compiler (``$CC``, else the one Python was built with, as
setuptools picks for the extension). The driver exits non-zero, and ``run``
raises, if any walk, comparison or insert in it went wrong.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "csrc" / name for name in ("trie_floor.c", "trie.c", "trie_share.c", "trie_arena.c")]
ORDER = ("sessions", "turns", "system", "task", "new_min", "new_max", "vocab", "query", "rounds")


def build(out_dir: Path) -> Path:
    """Compile the driver with the extension's release flags; raises CalledProcessError on failure."""
    exe = Path(out_dir) / "trie_floor"
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    cmd = [*cc, "-O3", "-Wall", "-Wno-unused-function", f"-I{ROOT / 'csrc'}", *map(str, SOURCES), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    return exe


def run(exe: Path, **workload: int) -> dict[str, float]:
    """The driver's figures (microseconds per call) for ``workload`` (all of ORDER)."""
    args = [str(workload[k]) for k in ORDER]
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout)


if __name__ == "__main__":
    import test_trie  # the benchmark's workload (this directory is on sys.path)

    (ROOT / "build").mkdir(exist_ok=True)
    print(json.dumps(run(build(ROOT / "build"), **test_trie.FLOOR_WORKLOAD)))
