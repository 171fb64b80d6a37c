"""One episode of the lookup environment: verifiers' own ``vf-eval``, unchanged, for one task and one rollout.

The program of ``tests/verifiers_recipe.py``'s ``AgentProgram``: the
verifiers venv's interpreter runs it once per episode, in a fresh directory
of its own, with the episode's session in its environment (see
``rlengine.rl.agent_program``): ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``
(the session's own base URL and token), ``RLENGINE_TASK`` (``{"key":
...}``, the task's name in the taskset), ``RLENGINE_SAMPLING``,
``RLENGINE_SEED``, ``RLENGINE_MAX_TURNS`` and ``RLENGINE_DEADLINE_S``;
its one argument is the served model's name.

It runs ``vf-eval lookup_env`` on that task with the built-in ``null``
harness (verifiers' own chat loop) as a local subprocess, offline as
``tests/frameworks/test_verifiers.py`` runs it: a stand-in ``uv`` (verifiers
prepares the harness's PEP 723 script with uv, which would fetch what the
venv already holds), a dead proxy for every host but this one, the platform
upload off twice. Then it prints the episode's result as its last stdout
line: ``{"reward": <the trace's reward, verifiers' Trace.reward: the sum of
its weighted rewards>, "metrics": {"tool_calls": ..., "turns": ...}}``. A
rollout verifiers reports as failed fails the episode (exit status 1).

It imports only the standard library: verifiers' imports (~6 s) are
``vf-eval``'s to pay, once per episode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = "episode"

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


def sampling_toml(sampling: dict[str, object], seed: int) -> str:
    """The episode's sampling settings as a ``vf-eval`` config file (a flag would pass the seed
    as a string: ``SamplingConfig`` keeps unknown keys untyped)."""
    values = {k: v for k, v in sampling.items() if v is not None} | {"seed": seed}
    return "[sampling]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())


def vf_eval(model: str, workdir: str) -> dict:
    """``vf-eval`` on the episode's task in ``workdir``; the one episode it wrote."""
    task = json.loads(os.environ["RLENGINE_TASK"])
    bin_dir, home = os.path.join(workdir, "bin"), os.path.join(workdir, "home")
    os.makedirs(bin_dir)
    os.makedirs(home)
    uv = os.path.join(bin_dir, "uv")
    with open(uv, "w") as f:
        f.write(UV_STANDIN)
    os.chmod(uv, 0o755)
    config = os.path.join(workdir, "sampling.toml")
    with open(config, "w") as f:
        f.write(sampling_toml(json.loads(os.environ["RLENGINE_SAMPLING"]), int(os.environ["RLENGINE_SEED"])))
    venv_bin = os.path.dirname(sys.executable)
    dead_proxy = "http://127.0.0.1:9"  # the discard port: any request for another host fails
    env = {
        "PATH": os.pathsep.join([bin_dir, venv_bin, os.defpath]),  # sh, mv, tail for its runtime
        "HOME": home,  # verifiers' cache, prepared scripts and runtime dirs land here
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONPATH": HERE,
        "VF_SCRIPT_PYTHON": sys.executable,
        "OPENAI_API_KEY": os.environ["OPENAI_API_KEY"],
        "PRIME_RUNS_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        **{name: dead_proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")},
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }
    argv = [os.path.join(venv_bin, "vf-eval"), "lookup_env", "@", config, "-m", model,
            "--client.base-url", os.environ["OPENAI_BASE_URL"], "--client.api-key-var", "OPENAI_API_KEY",
            "--client.timeout.read", os.environ["RLENGINE_DEADLINE_S"],
            "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess",
            "--env.agent.max-turns", os.environ["RLENGINE_MAX_TURNS"],
            "--select.include.names", json.dumps([task["key"]]),
            "-n", "1", "-r", "1", "-c", "1", "--no-push", "--no-rich", "-o", "outputs", "--run.name", RUN]
    # Its stdout (each trace as JSON) goes to stderr: this program's stdout ends with its result.
    code = subprocess.run(argv, env=env, cwd=workdir, stdout=sys.stderr, check=False).returncode
    if code != 0:
        sys.exit(f"vf-eval exited with code {code}")
    with open(os.path.join(workdir, "outputs", RUN, "traces.jsonl")) as f:
        [episode] = [json.loads(line) for line in f]
    return episode


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: run_episode.py MODEL (in an rlengine AgentProgram episode)")
    episode = vf_eval(sys.argv[1], os.getcwd())
    [trace] = episode["traces"]
    if not episode["ok"] or episode["errors"] or trace["errors"]:
        sys.exit(f"the rollout failed: {json.dumps(episode['errors'] or trace['errors'])[:2000]}")
    reward = sum(r["score"] * r["weight"] for r in trace["rewards"].values() if r is not None)
    calls = sum(len(node["message"].get("tool_calls") or []) for node in trace["nodes"])
    print(json.dumps({"reward": reward, "metrics": {"tool_calls": calls, "turns": len(trace["calls"])}}))


if __name__ == "__main__":
    main()
