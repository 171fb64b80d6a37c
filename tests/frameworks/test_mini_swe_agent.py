"""mini-swe-agent, unchanged, against ``rlengine serve``: the ``mini`` command's configuration
(``mini.yaml``: the LiteLLM model in its default tool-call mode, the local environment) with the
non-interactive ``DefaultAgent``, in a throwaway directory, step limit 3: a bash tool call that
writes a file, then the command that submits.

LiteLLM talks to a session's own base URL (``openai/`` model prefix,
``api_base``, the session token as the API key). Nothing may leave the
machine or write outside the test's directories: LiteLLM's cost map is the
one it ships (``LITELLM_LOCAL_MODEL_COST_MAP``), mini-swe-agent's global
config directory (created when it is imported, so it is imported in the
test) is under ``tmp_path``, and every name the process resolves is
recorded, so a lookup of any host but this one fails the test. Its prompts
are about 2,500 tokens of the tiny tokenizer, so the tiny model is built with
a longer context than its default 2,048. References: the file the command
wrote, the agent's exit status, and the script's tokens (what the session's
one trajectory must hold).
"""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest
from serving import WAIT, http_trace, open_http_session, sampled_segments, script_tokens, scripted

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

CALL = 'I will write the file.\n<tool_call>\n{"name":"bash","arguments":{"command":"echo hi > out.txt"}}\n</tool_call>'
SUBMIT = ('Done.\n<tool_call>\n{"name":"bash","arguments":{"command":"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}\n'
          '</tool_call>')


@pytest.fixture(scope="module")
def served(model_cache):
    s = scripted(model_cache, model_args={"max_position_embeddings": 8192})
    yield s
    s.close()


@pytest.fixture
def offline(monkeypatch, tmp_path) -> list[str]:
    """The environment mini-swe-agent and LiteLLM read (set before they are imported); the
    hosts any name lookup asked for, other than this machine's loopback."""
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_COST_TRACKING", "ignore_errors")  # the served model has no price
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # a refused request fails the test, at once
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    asked: list[str] = []
    lookup = socket.getaddrinfo

    def loopback_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            asked.append(str(host))
            raise OSError(f"{host}: a test must not reach the network")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    return asked


@pytest.fixture
def litellm_leaves_nothing_open():
    """LiteLLM's blocking ``completion`` runs its service hooks on the thread's event loop, and
    ``asyncio.get_event_loop()`` creates and installs one when there is none: that loop is given
    here and closed after, as is the OpenAI client (and its connection) LiteLLM caches."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()
    import litellm

    cache = litellm.in_memory_llm_clients_cache
    for client in list(cache.cache_dict.values()):
        if isinstance(client, openai.OpenAI):
            client.close()
    cache.flush_cache()


def test_the_default_agent_runs_a_command_then_submits_in_one_exact_trajectory(served, offline, tmp_path,
                                                                              litellm_leaves_nothing_open):
    from minisweagent.agents import get_agent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments import get_environment
    from minisweagent.models import get_model

    work = tmp_path / "work"
    work.mkdir()
    served.engines[0].backend.set_script([CALL, SUBMIT])
    opened = open_http_session(served)
    config = get_config_from_spec("mini.yaml")
    model_config = config["model"]
    model_config["model_kwargs"] = {**model_config.get("model_kwargs", {}), "api_base": opened["base_url"],
                                    "api_key": opened["token"], "timeout": WAIT, "num_retries": 0}
    model = get_model("openai/tiny", model_config)
    env = get_environment({**config["environment"], "cwd": str(work)}, default_type="local")
    agent = get_agent(model, env, {**config["agent"], "step_limit": 3}, default_type="default")
    assert agent.run("Write hi to out.txt") == {"exit_status": "Submitted", "submission": ""}
    assert (work / "out.txt").read_text() == "hi\n"
    assert [m["role"] for m in agent.messages] == ["system", "user", "assistant", "tool", "assistant", "exit"]
    assert offline == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config", "work"]
    [trajectory] = http_trace(served, opened)["trajectories"]  # the tool loop stayed one trajectory
    assert sampled_segments(trajectory) == [script_tokens(served, CALL), script_tokens(served, SUBMIT)]


def test_a_prompt_over_the_context_is_litellms_context_window_error(served, offline, litellm_leaves_nothing_open):
    # LiteLLM (mini-swe-agent's client) recognises OpenAI's context_length_exceeded and raises
    # ContextWindowExceededError, on which agents stop instead of retrying (with rlengine's first
    # message it raised a plain BadRequestError, which mini-swe-agent retried ten times).
    import litellm

    opened = open_http_session(served)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="openai/tiny", api_base=opened["base_url"], api_key=opened["token"], timeout=WAIT,
                           num_retries=0, messages=[{"role": "user", "content": "lorem ipsum " * 4000}])
    assert offline == []
