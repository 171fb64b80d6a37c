"""Drop root before a sandbox worker runs: ``python .../_confine.py PLAN -m module fd:N ...``.

A root trainer's ``SandboxPool`` starts each worker through this file, run by
path (it imports nothing of rlengine, only ``ctypes``, ``json``, ``os`` and
``sys``), then ``execv``s the worker's own command line. ``PLAN`` is JSON:
``{"uid": U, "hide": {"/root": ["/root/.pyenv/versions/3.11.7"], ...}}``
(no secret: tokens reach a worker only on its stdin), and ``"limits"``:
``[[resource, value], ...]``, set first.

1. ``hide``: directories other users cannot traverse (a 0700 ``/root``)
   that hold what the worker needs (the Python installation, ``PYTHONPATH``
   entries). The worker enters a mount namespace of its own, covers each
   such directory with an empty tmpfs, and mounts the needed directories
   back at their own paths, read-only. Everything else in them is gone for
   the worker; the trainer's view is unchanged.
2. ``uid``: it gives up root for uid and gid ``U`` (no supplementary groups),
   so it can read neither a sibling's memory (each slot has its own uid) nor
   the trainer's files or environment.

Where the kernel refuses a mount namespace (a container without
``CAP_SYS_ADMIN``) and something needed is hidden, it stays uid 0 but gives
up every capability instead (``capset`` to nothing, the bounding set
dropped, ``SECBIT_NOROOT`` locked, ``no_new_privs``), so it still cannot read
a sibling's memory (non-dumpable, no ``CAP_SYS_PTRACE``) or the trainer's
(whose capabilities it lacks), and says on stderr what it can still read:
root's files. Any other failure ends the worker before its code runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = (
    1, 2, 4, 32, 4096, 8192, 1 << 14, 1 << 18)
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 24, 28, 38, 47
_SECURE_NOROOT_ALL = 0xEF
"""NOROOT, NO_SETUID_FIXUP, KEEP_CAPS off and NO_CAP_AMBIENT_RAISE, each locked."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def hide(plan: dict[str, list[str]], stage: str) -> None:
    """A mount namespace in which each key of ``plan`` is an empty tmpfs holding only its listed
    directories (read-only, at their own paths). ``stage``: an empty directory to stage them in."""
    original, cwd = os.open("/proc/self/ns/mnt", os.O_RDONLY), os.getcwd()
    try:
        _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        try:
            _hide(plan, stage)
        except OSError:
            _check(_libc.setns(original, _CLONE_NEWNS), "setns")  # back to the trainer's view, whole
            os.chdir(cwd)  # setns moved it to the namespace's root
            raise
    finally:
        os.close(original)


def _hide(plan: dict[str, list[str]], stage: str) -> None:
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the trainer's view
    os.mkdir(stage, 0o700)
    staged = []
    for top, keep in plan.items():
        for path in keep:
            spot = os.path.join(stage, str(len(staged)))
            os.mkdir(spot, 0o700)
            _mount(path, spot, None, _MS_BIND | _MS_REC)
            staged.append((spot, path))
        _mount("tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    for spot, path in staged:
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(spot, path, None, _MS_MOVE)
        _mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY)


def drop_capabilities() -> None:
    """uid 0 with no capability, for good (also across exec)."""
    _check(_libc.prctl(_PR_SET_SECUREBITS, _SECURE_NOROOT_ALL, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    _check(_libc.prctl(_PR_CAP_AMBIENT, 4, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def main(argv: list[str]) -> None:
    import resource

    plan = json.loads(argv[1])
    uid = int(plan["uid"])
    for which, value in plan["limits"]:  # lowered while root; a worker cannot raise them again
        resource.setrlimit(which, (value, value))
    try:
        if plan["hide"]:
            hide(plan["hide"], plan["stage"])
    except OSError as exc:
        os.chown(".", 0, 0)  # its working directory, made for uid U
        drop_capabilities()
        print(f"rlengine sandbox: {exc}; running as uid 0 without capabilities instead of uid {uid}: "
              f"no access to other processes' memory, but root's files stay readable", file=sys.stderr)
    else:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.execv(sys.executable, [sys.executable, *argv[2:]])


if __name__ == "__main__":
    main(sys.argv)
