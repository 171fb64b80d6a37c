"""``python -m rlengine.tinker_api`` as a real process: serves the SDK with the key it drew, stops cleanly on SIGINT,
refuses bad settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

tinker = pytest.importorskip("tinker")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


def test_the_entry_point_serves_the_sdk_and_stops_on_sigint(tiny_model, model_cache, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rlengine.tinker_api", "--model", "tiny", "--backend", "torch",
                             "--port", "0", "--cache-dir", model_cache, "--checkpoint-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(XDG_RUNTIME_DIR=str(tmp_path / "run")))
    try:
        lines, url, printed = [], None, {}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"the server exited early: {''.join(lines)}"
            lines.append(line)
            if line.startswith("tinker: "):
                url = line.split(" ", 1)[1].strip()
            if line.startswith(("tinker key: ", "tinker key file: ")):
                name, _, value = line.strip().partition(": ")
                printed[name] = value
            if line.startswith("ready"):
                break
        assert url is not None and url.startswith("http://127.0.0.1:")
        key_file = tmp_path / "run" / "rlengine" / f"tinker-{url.rsplit(':', 1)[1]}.key"
        assert printed["tinker key file"] == str(key_file) and os.stat(key_file).st_mode & 0o777 == 0o600
        assert key_file.read_text().strip() == printed["tinker key"]
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=url, api_key="tml-guess").create_sampling_client(base_model="tiny").result(60)
        client = tinker.ServiceClient(base_url=url, api_key=printed["tinker key"])
        sampler = client.create_sampling_client(base_model="tiny").result(60)
        result = sampler.sample(tinker.types.ModelInput.from_ints([5, 6, 7]), 2,
                                tinker.types.SamplingParams(max_tokens=4, seed=0)).result(60)
        assert len(result.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in result.sequences)
        client.close("success").result(60)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGINT, out  # like rlengine serve and train
        assert "stopped" in out and not key_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_bad_settings_exit_2():
    proc = subprocess.run([sys.executable, "-m", "rlengine.tinker_api", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, env=_env(), timeout=120, check=False)
    assert proc.returncode == 2
    assert "api_key" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rlengine.tinker_api", "--host", "0.0.0.0", "--port", "0",
                           "--no-auth"], capture_output=True, text=True, env=_env(), timeout=120, check=False)
    assert proc.returncode == 2
    assert "no_auth=True is for loopback only" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rlengine.tinker_api", "--port", "0",
                           "--model-alias", "Qwen/Qwen3-8B"],
                          capture_output=True, text=True, env=_env(), timeout=120, check=False)
    assert proc.returncode == 2
    assert "--model-alias 'Qwen/Qwen3-8B': must be NAME=MODEL" in proc.stderr
