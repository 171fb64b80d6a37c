"""What confines a sandbox worker, decided by the trainer before the worker starts.

* ``hidden`` - for a worker under a uid of its own: the directories closed to other users that
  hold what it needs (the Python installation, its import paths), each mapped to the needed
  directories under it, which ``_confine`` mounts back read-only for the worker;
* ``rlimits`` and ``limit`` - its resource limits (no core files, open files, address space,
  CPU time): set from outside for a worker of the trainer's own uid, by ``_confine`` otherwise.

``rlengine.rl.sandbox_pool`` starts the workers; this module only plans (and ``limit`` applies
limits to a process that already runs).
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["hidden", "limit", "reachable", "rlimits"]


def reachable(path: str) -> bool:
    """Whether other users can traverse a directory (or read a file) at ``path``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    need = 0o005 if os.path.isdir(path) else 0o004
    return mode & need == need


def hidden(needed: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """For the directories a worker under another uid needs: the topmost directory on each one's
    path that other users cannot traverse, mapped to the needed directories under it (what
    ``_confine.hide`` mounts back for the worker); and the needed directories that are themselves
    closed to others (mounting them back would not open them)."""
    dirs = sorted({os.path.realpath(d) for d in needed if os.path.isdir(d)})
    dirs = [d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs)]
    plan: dict[str, list[str]] = {}
    closed: list[str] = []
    for d in dirs:
        if not reachable(d):
            closed.append(d)
            continue
        parts = d.split(os.sep)
        top = next((os.sep.join(parts[:i]) or os.sep for i in range(2, len(parts))
                    if not reachable(os.sep.join(parts[:i]))), None)
        if top is not None:
            plan.setdefault(top, []).append(d)
    return plan, closed


def rlimits(limits: dict[str, int | None]) -> list[tuple[int, int]]:
    """(resource, value) for every limit set: no core files, open files, address space, CPU time."""
    import resource

    settings = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, limits["open_files"]),
                (resource.RLIMIT_AS, limits["address_space_bytes"]), (resource.RLIMIT_CPU, limits["cpu_seconds"])]
    return [(which, value) for which, value in settings if value is not None]


def limit(pid: int, limits: dict[str, int | None]) -> None:
    """Resource limits for a new worker of the trainer's own uid, set from outside (uvloop runs no
    code between fork and exec). A root trainer's workers set them themselves (``_confine``),
    before they give up root: from outside, limiting another uid's process needs CAP_SYS_RESOURCE."""
    import resource

    for which, value in rlimits(limits):
        with contextlib.suppress(ProcessLookupError):  # it died already: its exit says why
            resource.prlimit(pid, which, (value, value))
