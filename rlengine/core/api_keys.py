"""The API key a loopback server draws when none is configured, and the private file it is written to.

Loopback is reachable by every user of a shared machine, so an HTTP or
Tinker server with neither ``api_key`` nor ``no_auth`` draws a random key
when it starts, as notebook servers do, and writes it where only its user
can read it: ``<kind>-<port>.key`` (mode 0600) in ``runtime_dir()``
(``$XDG_RUNTIME_DIR/rlengine``, else ``~/.rlengine/run``, mode 0700), or the
path the server's ``key_file`` names. The file is created with ``O_EXCL``
and mode 0600 in one call, so it never exists with wider permissions, and
the server removes it when it closes.

This module draws, writes and removes keys; checking a request's key is the
servers' work.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

from rlengine.config import is_loopback
from rlengine.errors import ConfigurationError

__all__ = ["DrawnKey", "check_auth", "runtime_dir"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def check_auth(api_key: str | None, no_auth: bool, key_file: str | None, host: str | None = None) -> None:
    """The settings a server config shares: a key, or ``no_auth``, or neither (a key is drawn); ``key_file``
    only where one is drawn; a ``host`` beyond loopback only with ``api_key`` (None: nothing is bound)."""
    if api_key is not None and not api_key:
        raise ConfigurationError("api_key='': must be a non-empty secret or None")
    if host is not None and api_key is None and not is_loopback(host):
        raise ConfigurationError(f"host={host!r}: not a loopback address; serving beyond this machine needs "
                                 "api_key (a shared secret every request must then carry)"
                                 + ("; no_auth=True is for loopback only" if no_auth else ""))
    if not isinstance(no_auth, bool):
        raise ConfigurationError(f"no_auth={no_auth!r}: must be True or False")
    if no_auth and api_key is not None:
        raise ConfigurationError("no_auth=True with api_key set: requests either need the key or need none; "
                                 "drop one")
    if key_file is not None:
        if not key_file:
            raise ConfigurationError("key_file='': must be a path or None")
        if api_key is not None or no_auth:
            raise ConfigurationError(f"key_file={key_file!r}: only a drawn key is written, and "
                                     f"{'api_key is set' if api_key is not None else 'no_auth=True draws none'}")


def runtime_dir() -> str:
    """``$XDG_RUNTIME_DIR/rlengine`` where that variable is set, else ``~/.rlengine/run``: created
    with mode 0700; one that another user owns, or that others may enter, is refused."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(xdg, "rlengine") if xdg else os.path.join(os.path.expanduser("~"), ".rlengine", "run")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigurationError(f"key directory {path!r}: cannot create it ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"key directory {path!r}: not a directory (a symlink or a file is in its place)")
    if st.st_uid != os.getuid():
        raise ConfigurationError(f"key directory {path!r}: owned by uid {st.st_uid}, not by this user "
                                 f"(uid {os.getuid()}); remove it, or set key_file")
    if st.st_mode & 0o077:
        raise ConfigurationError(f"key directory {path!r}: mode {stat.S_IMODE(st.st_mode):o}, open to other "
                                 f"users; it must be 700 (chmod 700 {path})")
    return path


class DrawnKey:
    """A random key for one server (``kind``: ``http``, ``tinker``) and the file it is written to.

    The directory is checked when the key is drawn, before the server binds,
    so a bad one fails the start before anything listens.
    """

    def __init__(self, kind: str, key_file: str | None, prefix: str = "") -> None:
        self.kind = kind
        self.key = prefix + secrets.token_urlsafe(32)
        """``prefix`` + 32 random bytes, URL-safe base64 (the Tinker SDK wants keys starting ``tml-``)."""
        self.path: str | None = None
        """Where it was written (None until ``write``, and after ``remove``)."""
        self._key_file = key_file
        self._dir = None if key_file is not None else runtime_dir()

    def write(self, port: int) -> str:
        """Write the key to ``key_file``, or ``<kind>-<port>.key`` in the runtime directory; returns the path."""
        path = self._key_file or os.path.join(self._dir or "", f"{self.kind}-{port}.key")
        try:
            try:
                fd = os.open(path, _CREATE, 0o600)
            except FileExistsError:
                if self._key_file is not None:
                    raise ConfigurationError(f"key_file={path!r}: exists; remove it (a server that was killed "
                                             "leaves its key file behind) or name another") from None
                # Left by a server that was killed: this port is ours now, so that server is gone.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                fd = os.open(path, _CREATE, 0o600)
        except OSError as exc:
            raise ConfigurationError(f"key_file={path!r}: cannot create it ({exc.strerror})") from None
        try:
            os.write(fd, f"{self.key}\n".encode())
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path = path
        return path

    def remove(self) -> None:
        """Delete the file, unless it is gone or another server's file has taken its place."""
        path, self.path = self.path, None
        if path is None:
            return
        # Its content says whose it is: a replacement may reuse the inode number at once.
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            try:
                ours = os.read(fd, 4096) == f"{self.key}\n".encode()
            finally:
                os.close(fd)
            if ours:
                os.unlink(path)
