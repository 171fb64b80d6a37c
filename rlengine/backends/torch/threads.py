"""How many intra-op threads torch gets: decided here, in one place.

On small CPU machines torch's default intra-op pool oversubscribes the cores
the event loop also needs; on this project's 2-vCPU machines two intra-op
threads were measured 15-30x slower than one, for the torch backend and for
plain HF ``generate`` alike. Machines with many cores keep torch's own
choice. ``decide`` picks, in order:

* ``RLENGINE_TORCH_THREADS=N`` if set (the override, N >= 1);
* else torch's own choice if ``OMP_NUM_THREADS`` is set (the user decided);
* else 1 thread on machines with at most 4 usable CPUs;
* else torch's own choice.

When training runs beside sampling (``EngineConfig.train_concurrently``) two
compute threads run torch at once; ``configure_threads(share=2)`` gives each
half of the decided count (at least one), and an explicit
``RLENGINE_TORCH_THREADS`` applies to each of them.

``rlengine.backends.torch.runtime.configure_threads`` applies the decision on
the engine's compute thread (the setting is per thread under OpenMP, and
every torch op of the engine runs there, vLLM's CPU model included);
``rlengine info`` reports it. Nothing else in rlengine sets thread counts or
``OMP_NUM_THREADS``. This module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from rlengine.errors import ConfigurationError

__all__ = ["SMALL_MACHINE_CPUS", "THREAD_VARIABLES", "ThreadDecision", "decide", "per_thread", "usable_cpus"]

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The environment variables that carry a thread setting; child processes that get a scrubbed
environment (sandbox workers) inherit these and nothing else of it that concerns threads."""

SMALL_MACHINE_CPUS = 4


class ThreadDecision(NamedTuple):
    threads: int | None
    """The intra-op thread count to set; None leaves torch's own choice."""
    why: str
    explicit: bool = False
    """Set by ``RLENGINE_TORCH_THREADS``: per compute thread, never split."""


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS has no sched_getaffinity
        return os.cpu_count() or 1


def decide(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> ThreadDecision:
    """The decision for ``environ`` (default: this process's) on ``cpus`` usable CPUs (default: counted)."""
    env = os.environ if environ is None else environ
    raw = env.get("RLENGINE_TORCH_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigurationError(f"RLENGINE_TORCH_THREADS={raw!r}: must be an integer >= 1")
        return ThreadDecision(n, f"RLENGINE_TORCH_THREADS={raw}", explicit=True)
    omp = env.get(THREAD_VARIABLES[0], "").strip()
    if omp:
        return ThreadDecision(None, f"OMP_NUM_THREADS={omp} is set: torch's own choice")
    cpus = usable_cpus() if cpus is None else cpus
    if cpus <= SMALL_MACHINE_CPUS:
        return ThreadDecision(1, f"{cpus} usable CPUs (<= {SMALL_MACHINE_CPUS}): one intra-op thread "
                                 "(two were measured 15-30x slower on 2 vCPUs); RLENGINE_TORCH_THREADS=N overrides")
    return ThreadDecision(None, f"{cpus} usable CPUs: torch's own choice")


def per_thread(decision: ThreadDecision, share: int, default: int) -> int | None:
    """The count for each of ``share`` compute threads running torch at once (``default``: torch's
    own count): a decided or default count split between them (at least one each), an explicit
    ``RLENGINE_TORCH_THREADS`` kept; None (one thread alone: torch's own choice) left as it is."""
    if share <= 1 or decision.explicit:
        return decision.threads
    return max(1, (decision.threads if decision.threads is not None else default) // share)
