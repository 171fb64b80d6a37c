"""The key a loopback server draws (rlengine.core.api_keys): its private directory, its 0600 file, its removal.

The servers' own tests (tests/serve/test_http.py, tests/tinker_api/) check
that requests need the key; these check the file system side, including
what another user or a killed server could have left in the way.
"""

from __future__ import annotations

import os
import stat

import pytest

from rlengine.core.api_keys import DrawnKey, check_auth, runtime_dir
from rlengine.errors import ConfigurationError


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_runtime_dir_is_created_private_under_xdg_runtime_dir_else_home(xdg, tmp_path, monkeypatch):
    assert runtime_dir() == str(xdg / "rlengine") and mode(xdg / "rlengine") == 0o700
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime_dir() == str(tmp_path / "home" / ".rlengine" / "run")
    assert mode(tmp_path / "home" / ".rlengine" / "run") == 0o700


def test_a_runtime_dir_open_to_others_or_not_a_directory_is_refused(xdg):
    (xdg / "rlengine").mkdir()
    os.chmod(xdg / "rlengine", 0o750)
    with pytest.raises(ConfigurationError, match="mode 750, open to other users.*chmod 700"):
        DrawnKey("http", None)
    os.rmdir(xdg / "rlengine")
    (xdg / "elsewhere").mkdir(mode=0o700)
    os.symlink(xdg / "elsewhere", xdg / "rlengine")
    with pytest.raises(ConfigurationError, match="not a directory"):
        runtime_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_runtime_dir_another_user_owns_is_refused(xdg):
    (xdg / "rlengine").mkdir(mode=0o700)
    os.chown(xdg / "rlengine", 12345, -1)
    with pytest.raises(ConfigurationError, match="owned by uid 12345, not by this user"):
        runtime_dir()


def test_the_key_file_is_0600_from_its_creation_and_removed(xdg):
    old = os.umask(0)  # even with no umask to narrow it, the file is never wider than 0600
    try:
        drawn = DrawnKey("tinker", None, prefix="tml-")
        path = drawn.write(8123)
    finally:
        os.umask(old)
    assert path == str(xdg / "rlengine" / "tinker-8123.key") and mode(path) == 0o600
    assert drawn.key.startswith("tml-") and len(drawn.key) > 40
    with open(path) as f:
        assert f.read() == drawn.key + "\n"
    assert DrawnKey("tinker", None).key != drawn.key
    drawn.remove()
    assert not os.path.exists(path)
    drawn.remove()  # twice is harmless


def test_a_file_a_killed_server_left_is_replaced_and_a_newer_one_is_not_removed(xdg):
    stale = xdg / "rlengine" / "http-9000.key"
    first = DrawnKey("http", None)
    first.write(9000)  # this server is then killed: its file stays
    second = DrawnKey("http", None)
    assert second.write(9000) == str(stale) and stale.read_text().strip() == second.key
    first.remove()  # the dead server's cleanup (had it run late) leaves the live one's file alone
    assert stale.read_text().strip() == second.key
    second.remove()
    assert not stale.exists()


def test_a_named_key_file_is_never_overwritten_or_followed(tmp_path):
    named = tmp_path / "key"
    named.write_text("mine")
    with pytest.raises(ConfigurationError, match="key_file=.*exists"):
        DrawnKey("http", str(named)).write(1)
    assert named.read_text() == "mine"
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(ConfigurationError, match="key_file=.*exists"):
        DrawnKey("http", str(tmp_path / "link")).write(1)
    assert not (tmp_path / "target").exists()
    with pytest.raises(ConfigurationError, match="cannot create it"):
        DrawnKey("http", str(tmp_path / "no" / "such" / "dir")).write(1)


def test_auth_settings_that_contradict_each_other_are_refused():
    check_auth(None, False, None)
    check_auth("s3cret", False, None)
    check_auth(None, True, None)
    check_auth(None, False, "/run/k")
    with pytest.raises(ConfigurationError, match="no_auth='yes': must be True or False"):
        check_auth(None, "yes", None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="no_auth=True with api_key set"):
        check_auth("s3cret", True, None)
    with pytest.raises(ConfigurationError, match="key_file='/k': only a drawn key is written, and api_key is set"):
        check_auth("s3cret", False, "/k")
    with pytest.raises(ConfigurationError, match="no_auth=True draws none"):
        check_auth(None, True, "/k")
    with pytest.raises(ConfigurationError, match="key_file=''"):
        check_auth(None, False, "")
