"""HTTP agent environments (``rlengine.rl.agents``): an agent that only knows a base URL and a key,
in a sandbox worker, with the official ``openai`` client and tools.

The engine is the scripted backend on the tiny model (its completions are
given, so no trained weights are needed) behind a real ``Server`` over HTTP;
the agents run in real sandbox processes. References: the script's tokens
(what the session must hold), the logprobs and texts the agent's own client
received, hand-built branch layouts.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap

import numpy as np
import pytest

from rlengine.config import EngineConfig
from rlengine.core.engine import Engine
from rlengine.errors import ConfigurationError
from rlengine.rl.advantages import trajectory_datums
from rlengine.rl.agents import AgentProgram, HttpAgentEnv
from rlengine.rl.rollouts import run_episode
from rlengine.rl.sandbox import SandboxPool
from rlengine.serve.server import ServeConfig, Server
from rlengine.types import SamplingParams

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWER = "It is sunny in Oslo."
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'

AGENT = textwrap.dedent("""
    import asyncio, os
    import openai
    from rlengine.rl.agents import agent_main

    TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

    async def play(job):
        task = job["task"]
        mode = task.get("mode", "tools")
        if mode == "crash":
            os._exit(5)
        client = openai.AsyncOpenAI(base_url=job["base_url"], api_key=job["api_key"], max_retries=0, timeout=30)
        async with client:
            if mode == "bad_key":
                client = client.with_options(api_key="wrong")
            messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
            got = {"logprobs": [], "texts": []}

            async def turn():
                reply = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                             logprobs=True, seed=job["seed"])
                choice = reply.choices[0]
                got["logprobs"].append([t.logprob for t in choice.logprobs.content])
                got["texts"].append(choice.message.content)
                return choice.message

            message = await turn()
            if mode == "sleep":
                await asyncio.sleep(task["sleep_s"])
            if not message.tool_calls:  # e.g. a malformed call: the agent answered nothing useful
                return {"reward": 0.0, **got, "metrics": {"called": 0.0}}
            call = message.tool_calls[0]
            messages.append(message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
            got["call"] = [call.function.name, call.function.arguments]
            answer = await turn()
            if mode == "branch":  # the agent rewrites its history and asks again: a second branch
                messages = [{"role": "user", "content": "Weather in Oslo, briefly?"}]
                answer = await turn()
            reward = 1.0 if answer.content == "It is sunny in Oslo." else 0.0
            if mode == "post":
                await client.post("/reward", body={"value": 0.25}, cast_to=object)
                return {**got, "metrics": {"called": 1.0}}
            return {"reward": reward, **got, "metrics": {"called": 1.0}}

    agent_main(play)
""")


@pytest.fixture
def agent_module(tmp_path, monkeypatch):
    (tmp_path / "weather_agent.py").write_text(AGENT)
    tmp_path.chmod(0o755)  # a root trainer's workers run under uids of their own
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "weather_agent"


def run_served(model_cache, script, body):
    """``body(server, engine)`` on a loop with the scripted tiny model served over HTTP."""
    async def main():
        cfg = EngineConfig(backend="scripted", model_name="tiny", cache_dir=model_cache,
                           engine_args={"script": list(script)})
        async with Engine(cfg) as engine, Server(engine, ServeConfig(ipc=False)) as server:
            return await body(server, engine)

    return asyncio.run(main())


def tokens_of(engine, text):
    tok = engine.tokenizer
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


PARAMS = SamplingParams(max_tokens=64, temperature=1.0)


def test_the_trained_trace_is_what_the_agents_client_received(model_cache, agent_module):
    async def body(server, engine):
        async with SandboxPool(agent_module, 1, job_timeout_s=30.0) as pool:
            await pool.start(None)
            env = HttpAgentEnv(pool, server, {"mode": "tools"}, deadline_s=20.0)
            return env, await env.run(PARAMS, 7, 8), tokens_of(engine, CALL), tokens_of(engine, ANSWER)

    env, t, call, answer = run_served(model_cache, [CALL, ANSWER], body)
    assert not t.failed and t.metadata["branches"] == 1
    assert [tr.action.tokens for tr in t.transitions] == [call, answer]
    # The logprobs trained on are those the client got (its last one is the end token's, which
    # the API reports with the turn's tokens).
    got = env.result["logprobs"]
    for tr, lps in zip(t.transitions, got, strict=True):
        np.testing.assert_allclose(tr.action.logprobs[:len(lps)], lps, rtol=0, atol=1e-6)
    assert env.result["call"] == ["get_weather", '{"city": "Oslo"}'] and env.result["texts"][-1] == ANSWER
    assert [tr.reward for tr in t.transitions] == [0.0, 1.0] and t.transitions[-1].metrics == {"called": 1.0}
    # The second turn extends the first token for token: one training sequence per episode.
    assert len(trajectory_datums(t, 1.0, with_mask=False)) == 1


def test_reward_sources_posted_and_reward_fn_win_over_returned(model_cache, agent_module):
    seen = []

    async def score(trace, task, result):
        seen.append((trace.session_id, task, sorted(result)))
        return 0.5

    async def body(server, engine):
        async with SandboxPool(agent_module, 1, job_timeout_s=30.0) as pool:
            await pool.start(None)
            posted = await HttpAgentEnv(pool, server, {"mode": "post"}).run(PARAMS, 1, 8)
            scored = await HttpAgentEnv(pool, server, {"mode": "tools"}, reward_fn=score).run(PARAMS, 2, 8)
            return posted, scored

    posted, scored = run_served(model_cache, [CALL, ANSWER], body)
    assert posted.step_reward == 0.25  # posted to the session's own base URL (POST .../v1/reward)
    assert scored.step_reward == 0.5 and seen[0][1] == {"mode": "tools"} and "logprobs" in seen[0][2]


def test_a_branched_session_trains_each_sampled_token_once_or_only_its_last_branch(model_cache, agent_module):
    async def body(server, engine):
        async with SandboxPool(agent_module, 1, job_timeout_s=30.0) as pool:
            await pool.start(None)
            everything = await HttpAgentEnv(pool, server, {"mode": "branch"}).run(PARAMS, 3, 8)
            last = await HttpAgentEnv(pool, server, {"mode": "branch"}, branches="last").run(PARAMS, 3, 8)
            return everything, last, tokens_of(engine, CALL), tokens_of(engine, ANSWER)

    everything, last, call, answer = run_served(model_cache, [CALL, ANSWER, ANSWER], body)
    assert everything.metadata["branches"] == 2 and last.metadata["branches"] == 2
    # All branches: the first holds the call and its answer, the second its own answer; nothing twice.
    assert [tr.action.tokens for tr in everything.transitions] == [call, answer, answer]
    datums = trajectory_datums(everything, 1.0, with_mask=False)
    assert len(datums) == 2 and sum(int(d.mask.sum()) for d in datums) == len(call) + 2 * len(answer)
    assert all(np.all(d.datum.loss_fn_inputs["advantages"].to_numpy()[d.mask > 0] == 1.0) for d in datums)
    # Only the last branch: the rewritten conversation and its one answer.
    assert [tr.action.tokens for tr in last.transitions] == [answer]
    assert last.transitions[0].observation == everything.transitions[2].observation
    assert everything.step_reward == last.step_reward == 1.0


def test_a_malformed_tool_call_is_a_reward_not_a_failure(model_cache, agent_module):
    async def body(server, engine):
        async with SandboxPool(agent_module, 1, job_timeout_s=30.0) as pool:
            await pool.start(None)
            env = HttpAgentEnv(pool, server, {"mode": "tools"})
            return env, await env.run(PARAMS, 4, 8), tokens_of(engine, MALFORMED)

    env, t, malformed = run_served(model_cache, [MALFORMED], body)
    assert not t.failed and t.step_reward == 0.0 and t.transitions[-1].metrics == {"called": 0.0}
    assert [tr.action.tokens for tr in t.transitions] == [malformed] and env.result["texts"] == [MALFORMED]


def test_crashes_deadlines_and_http_errors_fail_the_attempt_with_their_kind(model_cache, agent_module):
    async def body(server, engine):
        out = {}
        async with SandboxPool(agent_module, 1, job_timeout_s=30.0) as pool:
            await pool.start(None)
            for mode, extra in (("crash", {}), ("bad_key", {}), ("tools", {}), ("sleep", {"sleep_s": 4.0})):
                # A warm worker's first turn comes well within 2 s; the sleeping agent's second does not.
                env = HttpAgentEnv(pool, server, {"mode": mode, **extra}, deadline_s=2.0 if mode == "sleep" else None)
                out[mode] = await run_episode(env, None, PARAMS, 5, max_turns=8)
            out["after"] = await run_episode(HttpAgentEnv(pool, server, {"mode": "tools"}), None, PARAMS, 6,
                                             max_turns=8)
            out["spawned"] = pool.spawned
            out["live"] = server.sessions.live()
        return out

    out = run_served(model_cache, [CALL, ANSWER], body)
    assert out["crash"].failure.kind == "crash" and "exited with code 5" in out["crash"].failure.message
    assert out["bad_key"].failure.kind == "http" and "PermissionDenied" in out["bad_key"].failure.message
    # The agent slept past its deadline: the session was retired under it, its next turn refused (410).
    assert out["sleep"].failure.kind == "timeout" and "deadline_s=2.0" in out["sleep"].failure.message
    assert not out["after"].failed  # the run goes on
    assert not out["tools"].failed
    assert out["spawned"] == 2 and out["live"] == []  # every session was collected


def test_the_sandbox_bound_must_exceed_deadline_plus_scoring_and_keys_stay_out_of_argv(model_cache):
    async def body(server, engine):
        pool = SandboxPool("unused", 1, job_timeout_s=10.0)
        with pytest.raises(ConfigurationError, match="must exceed deadline_s \\+ scoring_s = 10.0"):
            HttpAgentEnv(pool, server, {}, deadline_s=8.0, scoring_s=2.0)
        HttpAgentEnv(pool, server, {}, deadline_s=8.0, scoring_s=1.5)

    run_served(model_cache, ["ok"], body)
    with pytest.raises(ConfigurationError, match="never put in arguments"):
        AgentProgram(["agent", "--key", "{api_key}"])
    with pytest.raises(ConfigurationError, match="known placeholders"):
        AgentProgram(["agent", "{nope}"])


PROGRAM = textwrap.dedent("""
    import json, os, sys, urllib.request
    base, sid = sys.argv[1], sys.argv[2]
    assert base == os.environ["OPENAI_BASE_URL"] and sid == os.environ["RLENGINE_SESSION_ID"]
    assert os.environ["OPENAI_API_KEY"] not in " ".join(sys.argv)
    task = json.loads(os.environ["RLENGINE_TASK"])
    if task.get("fail"):
        print("something broke", file=sys.stderr)
        sys.exit(4)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": task["q"]}]}).encode()
    req = urllib.request.Request(base + "/chat/completions", body, {
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    answer = json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]["content"]
    print("chatter on stdout")
    print(json.dumps({"reward": float(answer == task["want"]), "metrics": {"chars": len(answer)}}))
""")


def test_any_program_runs_once_per_episode_with_the_session_in_its_environment(model_cache, tmp_path):
    (tmp_path / "agent.py").write_text(PROGRAM)
    tmp_path.chmod(0o755)
    program = AgentProgram([sys.executable, str(tmp_path / "agent.py"), "{base_url}", "{session_id}"])

    async def body(server, engine):
        async with program.pool(1, job_timeout_s=30.0) as pool:
            await pool.start(None)
            good = await HttpAgentEnv(pool, server, {"q": "hi", "want": ANSWER}).run(PARAMS, 1, 4)
            bad = await run_episode(HttpAgentEnv(pool, server, {"fail": True}), None, PARAMS, 2, max_turns=4)
            return good, bad, tokens_of(engine, ANSWER), pool.spawned

    good, bad, answer, spawned = run_served(model_cache, [ANSWER], body)
    assert good.step_reward == 1.0 and good.transitions[-1].metrics == {"chars": float(len(ANSWER))}
    assert [tr.action.tokens for tr in good.transitions] == [answer]
    assert bad.failure.kind == "other" and "exited with code 4: something broke" in bad.failure.message
    assert spawned == 1  # a failing program is not a failing worker
