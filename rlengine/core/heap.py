"""The cyclic garbage collector kept off the heap that start-up built.

By the time a run's first step starts, the process holds several hundred
thousand long-lived objects: torch's, transformers', the engine's and the
recipe's (427,000 in a ``copy`` run, TRL imported beside it). CPython's full
collection walks all of them, and a run's steps make enough new objects to
trigger one every 20-30 steps: 180-280 ms each on the 2-vCPU machine of
bench/RESULTS.md, with every thread stopped (the collector holds the GIL),
about 11 ms a step on average where a ``copy`` step takes 160. The young
generations' collections cost 2-3 ms a step besides, and stay as they are.

``frozen_heap`` moves every object alive when it is entered into the
collector's permanent generation (``gc.freeze``, O(1)), which later
collections skip, and moves them back when it exits (``gc.unfreeze``). What
it changes for the program: nothing but the pauses. An object that was alive
at the freeze and later becomes unreachable *inside a reference cycle* waits
for the unfreeze to be collected (reference counting still frees everything
that is not in a cycle at once); cycles made after the freeze are collected
as always. No ``gc.collect`` before the freeze: a full collection costs as
much as the pause it avoids, and garbage frozen with the heap is collected
after the unfreeze.

Nested or overlapping use (a run inside a caller's own ``frozen_heap``, two
runs in one process, one per thread) freezes once and unfreezes when the
last one exits. A process that froze its heap itself (``gc.get_freeze_count()``
above 0 at the first entry) keeps it frozen: the exit leaves the permanent
generation to it. The bookkeeping is thread-safe; the freeze itself is
process-wide, as the collector is.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["frozen_heap"]

_lock = threading.Lock()
_depth = 0
_unfreeze_at_exit = False


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the collector's full collections off the objects alive now, until exit (module docstring)."""
    global _depth, _unfreeze_at_exit
    with _lock:
        if _depth == 0:
            _unfreeze_at_exit = gc.get_freeze_count() == 0
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _unfreeze_at_exit:
                gc.unfreeze()
