"""verifiers' ``vf-eval`` CLI, unchanged, against ``rlengine serve``: a one-tool environment
(``lookup(key)``, served over MCP as verifiers serves every tool), two tasks whose answer is the
tool's value, scored by the task's own reward.

verifiers pins ``openai`` 2.x, which the main environment cannot hold, so it
lives in its own virtualenv (``RLENGINE_VERIFIERS_VENV``, default
``.venv-verifiers`` in the repository; see ``VENV_HINT``) and ``vf-eval`` runs
from there as a subprocess. Its path through a rollout: the built-in ``null``
harness (verifiers' own chat loop, streamed Chat Completions with tools) runs
as a local subprocess and talks to an interception server inside ``vf-eval``,
which relays each request to the ``--client.base-url`` endpoint with an
``X-Session-ID`` header (the rollout's trace id; for rlengine an affinity hint).
That harness is a PEP 723 script that verifiers prepares with ``uv``, which
would fetch its dependencies; they are all in the verifiers venv already, so a
stand-in ``uv`` (``UV_STANDIN``) answers ``uv python find`` with the venv's
interpreter. Nothing else is replaced.

Nothing may leave the machine: the process gets a scrubbed environment
(``HOME``, so verifiers' cache and runtime directories, under ``tmp_path``; a
dead proxy for every host but this one; the platform upload off twice,
``--no-push`` and ``PRIME_RUNS_MODE=disabled``). The one file written outside
``tmp_path`` is verifiers' own: a tool server reports its port in
``/tmp/vf-port-<uuid>`` (a fixed path in ``verifiers/v1/mcp/launch.py``) and
nobody removes it. The two runs take about 17 s each, mostly imports
(``import verifiers.v1`` alone is ~6 s, paid by ``vf-eval`` and by the tool
server). References: the tool's own record of its calls,
the reward the task's scoring gave, the engine's count of admitted sequences,
and the script's tokens (what a session's one trajectory must hold).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from serving import REPO, WAIT, http_trace, open_http_session, sampled_segments, script_tokens, scripted

pytestmark = [pytest.mark.slow, pytest.mark.model_plane]

VENV = os.environ.get("RLENGINE_VERIFIERS_VENV", os.path.join(REPO, ".venv-verifiers"))
VENV_HINT = ("python -m venv .venv-verifiers && .venv-verifiers/bin/pip install -q verifiers==0.4.0 "
             "(in the repository root, or point RLENGINE_VERIFIERS_VENV at such a venv)")
VERSION = "0.4.0"
VF_EVAL_TIMEOUT_S = 120

VALUES = {"alpha": "42", "beta": "7"}
CALL = {key: f'<tool_call>\n{{"name":"lookup","arguments":{{"key":"{key}"}}}}\n</tool_call>' for key in VALUES}
ANSWER = {key: f"The value of {key} is {value}." for key, value in VALUES.items()}

# The environment, as a verifiers user writes one: a taskset module exporting its Taskset, with a
# taskset-scoped Toolset (verifiers starts it once per eval, as `python -m lookup_env`; a
# task-scoped one would cost a server start, ~7 s of imports, per rollout).
ENV_MODULE = f'''
"""A one-tool verifiers environment: look a key up, answer with its value."""

import os

import verifiers.v1 as vf

VALUES = {VALUES!r}


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is advertised as `lookup`, not `lookup_toolset_lookup`

    @vf.tool
    def lookup(self, key: str) -> str:
        """The value stored under a key."""
        with open(os.environ["LOOKUP_CALLS"], "a") as f:
            f.write(key + "\\n")
        return VALUES.get(key, "unknown")


class LookupData(vf.TaskData):
    answer: str


class LookupTask(vf.Task[LookupData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip().endswith(f" is {{self.data.answer}}."))


class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [LookupToolset(vf.SharedToolsetConfig())]

    def load(self):
        for key, value in VALUES.items():
            yield LookupTask(LookupData(prompt=f"What is the value of {{key}}? Use the lookup tool.", answer=value),
                             self.config.task)


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    LookupToolset.run()
'''

# What verifiers asks of uv (runtimes/base.py, `prepare_uv_script`): that `uv sync --help` and
# `uv python find --help` mention --script, then `uv sync --script F` and `uv python find --script F`.
UV_STANDIN = """\
#!/bin/sh
case "$*" in
  *--help*) echo "--script" ;;
  "sync --script "*) ;;
  "python find --script "*) echo "$VF_SCRIPT_PYTHON" ;;
  *) echo "uv stand-in: not supported: $*" >&2; exit 2 ;;
esac
"""


@pytest.fixture(scope="module")
def venv_python() -> str:
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(os.path.join(VENV, "bin", "vf-eval")):
        pytest.fail(f"no verifiers venv at {VENV} (it needs verifiers=={VERSION}); create it with: {VENV_HINT}")
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('verifiers'))"],
                           capture_output=True, text=True, timeout=WAIT, check=False)
    if probe.stdout.strip() != VERSION:
        pytest.fail(f"{VENV} holds verifiers {probe.stdout.strip() or probe.stderr.strip()!r}, not {VERSION}; "
                    f"recreate it with: {VENV_HINT}")
    return python


@pytest.fixture(scope="module")
def served(model_cache):
    # verifiers' requests carry ~500 prompt tokens; the default context holds them.
    s = scripted(model_cache)
    yield s
    s.close()


def admitted(served) -> int:
    return served.on_loop(lambda: served.engines[0].stats()["admitted"])


def vf_eval(python: str, tmp_path, base_url: str, api_key: str, limit: int) -> list[dict]:
    """Run ``vf-eval`` on the lookup environment (``limit`` tasks, one rollout each, one at a
    time, so the script's texts go to the turns in order); its episodes, from ``traces.jsonl``."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    for folder in (tmp_path / "env", bin_dir, home):
        folder.mkdir()
    (tmp_path / "env" / "lookup_env.py").write_text(ENV_MODULE)
    (bin_dir / "uv").write_text(UV_STANDIN)
    (bin_dir / "uv").chmod(0o755)
    venv_bin = os.path.dirname(python)
    dead_proxy = "http://127.0.0.1:9"  # the discard port: any request for another host fails
    env = {
        "PATH": os.pathsep.join([str(bin_dir), venv_bin, os.defpath]),  # sh, mv, tail for its runtime
        "HOME": str(home),  # verifiers' cache, prepared scripts and runtime dirs land here
        "TMPDIR": str(tmp_path),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(tmp_path / "env"),
        "VF_SCRIPT_PYTHON": python,
        "LOOKUP_CALLS": str(tmp_path / "calls.txt"),
        "RLENGINE_API_KEY": api_key,
        "PRIME_RUNS_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        **{name: dead_proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")},
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }
    argv = [os.path.join(venv_bin, "vf-eval"), "lookup_env", "-m", "tiny",
            "--client.base-url", base_url, "--client.api-key-var", "RLENGINE_API_KEY",
            "--client.timeout.read", str(WAIT),
            "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess",
            "-n", str(limit), "-r", "1", "-c", "1", "--no-push", "--no-rich", "-o", "outputs", "--run.name", "lookup"]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=VF_EVAL_TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, f"vf-eval exited {done.returncode}:\n{done.stderr[-4000:]}"
    with open(tmp_path / "outputs" / "lookup" / "traces.jsonl") as f:
        return [json.loads(line) for line in f]


def calls_made(tmp_path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_vf_eval_runs_the_tool_environment_and_scores_it(venv_python, served, tmp_path):
    served.engines[0].backend.set_script([CALL["alpha"], ANSWER["alpha"], CALL["beta"], ANSWER["beta"]])
    before = admitted(served)
    episodes = vf_eval(venv_python, tmp_path, served.http_url, served.api_key, limit=2)
    assert calls_made(tmp_path) == ["alpha", "beta"]  # the tool server really ran the calls
    # Two turns per rollout, each carrying X-Session-ID (the trace id) and no session token:
    # served statelessly, the id only an affinity hint.
    assert admitted(served) - before == 4
    assert [e["ok"] and not e["errors"] for e in episodes] == [True, True]
    for episode, key in zip(episodes, VALUES):
        [trace] = episode["traces"]
        assert trace["errors"] == [] and trace["rewards"] == {"correct": {"score": 1.0, "weight": 1.0}}
        assert [t["name"] for t in trace["tools"]] == ["lookup"]
        assert [(c["endpoint"], c["finish_reason"]) for c in trace["calls"]] == [
            ("/chat/completions", "tool_calls"), ("/chat/completions", "stop")]
        user, asked, told, answered = (node["message"] for node in trace["nodes"])
        assert user["content"] == f"What is the value of {key}? Use the lookup tool."
        [call] = asked["tool_calls"]
        assert call["name"] == "lookup" and json.loads(call["arguments"]) == {"key": key}
        assert told == {"role": "tool", "tool_call_id": call["id"], "content": VALUES[key], "name": "lookup"}
        assert answered == {"role": "assistant", "content": ANSWER[key]}


def test_a_rollout_on_a_session_base_url_is_one_exact_trajectory(venv_python, served, tmp_path):
    served.engines[0].backend.set_script([CALL["alpha"], ANSWER["alpha"]])
    opened = open_http_session(served)
    [episode] = vf_eval(venv_python, tmp_path, opened["base_url"], opened["token"], limit=1)
    assert episode["ok"] and episode["traces"][0]["rewards"] == {"correct": {"score": 1.0, "weight": 1.0}}
    assert calls_made(tmp_path) == ["alpha"]
    trace = http_trace(served, opened)
    [trajectory] = trace["trajectories"]  # the tool loop stayed one trajectory
    assert sampled_segments(trajectory) == [script_tokens(served, CALL["alpha"]), script_tokens(served, ANSWER["alpha"])]
    tok = served.engines[0].tokenizer
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(trajectory["tokens"], skip_special_tokens=False)
