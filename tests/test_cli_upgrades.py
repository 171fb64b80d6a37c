"""Upgrades that keep working (issue 32): ``rlengine --version``, a CHANGELOG that names what moved
and when its old path goes, and a 401 that says where the server's key is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import rlengine
from rlengine._moved import MOVED, REMOVED_IN

ROOT = Path(__file__).resolve().parent.parent


def test_version_prints_the_version():
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", "--version"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"rlengine {rlengine.__version__}\n"


def test_the_changelog_names_every_moved_module_and_when_its_old_path_goes():
    text = " ".join((ROOT / "CHANGELOG.md").read_text().split())  # as read, whatever the line breaks
    for old, new in MOVED.items():
        assert f"`{old}` -> `{new}`" in text, old
    assert f"removed in {REMOVED_IN}" in text


def test_a_401_names_the_file_that_holds_the_drawn_key(tmp_path):
    openai = pytest.importorskip("openai")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlengine.cli", "serve", "backend=sim", "ipc=false"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        shown: dict[str, str] = {}
        for line in proc.stdout:  # the addresses, then "ready" (a few seconds)
            key, _, value = line.strip().partition(": ")
            shown[key] = value
            if key == "ready":
                break
        assert "http key file" in shown, (shown, proc.stderr.read() if proc.poll() is not None else "")
        key_file = shown["http key file"]
        assert key_file == str(tmp_path / "rlengine" / f"http-{shown['http'].split(':')[-1].split('/')[0]}.key")
        client = openai.OpenAI(base_url=shown["http"], api_key="not-the-key", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as caught:
            client.models.list()
        message = caught.value.body["message"]  # type: ignore[index]
        assert f"it is in {key_file}" in message and "OPENAI_API_KEY" in message, message
        assert openai.OpenAI(base_url=shown["http"], api_key=Path(key_file).read_text().strip(), max_retries=0,
                             timeout=30).models.list().data
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
