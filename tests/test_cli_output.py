"""What the ``rlengine`` commands print (issue 32): plain help, valid choices named, one line for
a taken port, and other libraries' logs kept down unless ``-v``.

Each runs the real command in a subprocess, its output a pipe (no terminal).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300


# What ``rlengine.console.quiet_third_party`` sets: a user's shell has none of them, so neither has
# the command's environment here (an earlier in-process command may have left them in this one's).
_LOG_VARIABLES = ("VLLM_LOGGING_", "TRANSFORMERS_", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "TQDM_", "HF_HUB_DISABLE_")


def rlengine(*args: str, env: dict[str, str] | None = None, timeout: float = WAIT_S) -> tuple[int, str, str]:
    plain = {k: v for k, v in os.environ.items() if not k.startswith(_LOG_VARIABLES)}
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**plain, "OMP_NUM_THREADS": "1", **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("command", [[], ["train"], ["serve"], ["info"], ["bench"]])
def test_help_is_plain_text(command):
    code, out, err = rlengine(*command, "--help")
    assert code == 0, err
    assert "``" not in out, out
    assert "usage: rlengine" in out


def test_serve_names_the_valid_choices_of_a_setting():
    code, _, err = rlengine("serve", "backend=nosuch")
    assert code == 2, err
    assert "backend='nosuch': must be 'auto', 'sim', 'torch'" in err, err
    code, _, err = rlengine("serve", "drain_policy=x")
    assert code == 2 and "drain_policy='x': must be 'wait' or 'pause'" in err, err


@pytest.mark.parametrize("where", ["port", "tinker.port"])
def test_serve_on_a_taken_port_is_one_line_and_exit_2(where):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = ["--tinker"] if where == "tinker.port" else []
        code, out, err = rlengine("serve", *extra, "backend=sim", f"{where}={port}", timeout=120)
    assert code == 2, (out, err)  # the old code: OSError's traceback, exit 1
    want = (f"rlengine serve: {where}={port}: cannot listen on 127.0.0.1:{port}, in use (another process listens "
            f"there); choose another {where}=N, or {where}=0 for any free port")
    assert err.splitlines() == [want], err


def _ours(line: str) -> bool:
    """A line ``rlengine train`` prints itself: progress and errors, the summary, the metrics path."""
    return line.startswith(("rlengine train", "  ", "/"))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_train_keeps_vllm_quiet_unless_verbose(tmp_path, verbose):
    pytest.importorskip("vllm")
    code, out, err = rlengine("train", "copy", "backend=vllm", "steps=1", "eval_every=0", "--run-dir",
                              str(tmp_path / "run"), *(["-v"] if verbose else []))
    assert code == 0, err
    # stdout is the command's own either way (vLLM logged ~40 lines there before).
    assert all(map(_ours, out.splitlines())), out
    others = [line for line in err.splitlines() if not _ours(line)]
    if verbose:
        assert any("Loading safetensors checkpoint shards" in line for line in others), err
        assert sum(" INFO " in line for line in others) >= 5, err
    else:
        assert others == [], err


TOKENIZE_LONG = textwrap.dedent("""
    import sys
    from rlengine.console import quiet_third_party
    quiet_third_party(verbose=sys.argv[1] == "verbose")
    from transformers import AutoTokenizer
    from rlengine.backends.torch.models import prepare_char_model
    path = prepare_char_model("0123456789=$", "$", cache_dir=sys.argv[2], seed=0, max_position_embeddings=16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(len(tokenizer("0123456789" * 4)["input_ids"]))
""")


@pytest.mark.model_plane
@pytest.mark.parametrize("verbose", [False, True])
def test_quiet_third_party_mutes_transformers_warnings_unless_verbose(tmp_path, verbose):
    """transformers' "longer than the specified maximum sequence length" warning, as a train run
    with a long conversation met it."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "TQDM_DISABLE")}
    proc = subprocess.run([sys.executable, "-c", TOKENIZE_LONG, "verbose" if verbose else "quiet", str(tmp_path)],
                          capture_output=True, text=True, timeout=WAIT_S, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 16
    assert ("longer than the specified maximum sequence length" in proc.stderr) is verbose, proc.stderr


def test_importing_the_commands_changes_no_logging_of_the_host():
    """Only a command quiets other libraries: importing rlengine (or its command modules) leaves the
    host program's environment alone."""
    code = ("import os\nbefore = dict(os.environ)\n"
            "import rlengine, rlengine.cli, rlengine.rl.cli, rlengine.serve.cli, rlengine.console\n"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_a_reader_that_stops_early_gets_no_traceback():
    """``rlengine train --list | head -1``."""
    with subprocess.Popen([sys.executable, "-m", "rlengine.cli", "train", "--list"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("recipes")
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141
