"""Build script: setuptools metadata lives in pyproject.toml; compiled
extensions (the C token trie under csrc/) are declared here.

The extension is required: a compile error fails the install, loudly. Set
``RLENGINE_BUILD=debug`` for ``-O0 -g`` or ``RLENGINE_BUILD=asan`` for an
AddressSanitizer build (see the Makefile); the default is ``-O3``.
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

_FLAGS = {
    "release": ["-O3", "-Wall", "-Wno-unused-function"],
    "debug": ["-O0", "-g", "-Wall", "-Wno-unused-function"],
    # Tiny blocks, eager compaction: the tests' small tries then exercise
    # every path of csrc/trie_arena.c under the sanitizers.
    "asan": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-DRLE_BLOCK_MIN=64",
             "-DRLE_COMPACT_MIN=16"],
}
_mode = os.environ.get("RLENGINE_BUILD", "release")
if _mode not in _FLAGS:
    raise SystemExit(f"RLENGINE_BUILD={_mode!r}: must be one of {sorted(_FLAGS)}")

trie = Extension(
    "rlengine.trace._trie",
    sources=["rlengine/trace/_trie.pyx", "csrc/trie.c", "csrc/trie_share.c", "csrc/trie_arena.c"],
    depends=["csrc/trie.h", "csrc/trie_arena.h", "rlengine/trace/_trie.pxd"],
    include_dirs=["csrc"],
    extra_compile_args=_FLAGS[_mode],
    extra_link_args=["-fsanitize=address,undefined"] if _mode == "asan" else [],
)

setup(ext_modules=cythonize([trie], language_level=3, compiler_directives={"embedsignature": True}))
