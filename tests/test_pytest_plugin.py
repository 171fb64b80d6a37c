"""The pytest plugin (``rlengine.pytest_plugin``), run as a user's suite would run it.

Each test writes a small user suite and runs it with ``pytester`` in a fresh
pytest process, which loads the plugin through its ``pytest11`` entry point
as any test run where rlengine is installed does. The suites take the
fixtures, assert on what they got, and check after their own teardown that
engines, servers and clients are closed. Every run is bounded; the sim
suites take seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

RUN_TIMEOUT_S = 180.0


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # Warnings are errors in the user's run too: an unclosed socket or a thread
    # that raised at teardown would otherwise pass unseen. The user's suite runs in its
    # file's order (its last test checks what the earlier ones left), whatever order this one runs in.
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "error", *args,
                                         timeout=RUN_TIMEOUT_S)


def test_the_plugin_is_registered_and_its_import_stays_light():
    code = (
        "import importlib.metadata, sys\n"
        "[ep] = [e for e in importlib.metadata.entry_points(group='pytest11') if e.name == 'rlengine']\n"
        "assert ep.value == 'rlengine.pytest_plugin', ep\n"
        "ep.load()\n"
        "heavy = sorted(m for m in sys.modules if m in ('torch', 'numpy', 'aiohttp', 'msgspec')\n"
        "               or m.startswith('rlengine.') and m != 'rlengine.pytest_plugin')\n"
        "assert heavy == [], heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


SIM_SUITE = """
import rlengine as rle

seen = {}


def test_sample_latency(benchmark, rlengine_sim_engine):
    sampler = rlengine_sim_engine.sampling_client()
    params = rle.SamplingParams(max_tokens=8)
    resp = benchmark(lambda: sampler.sample([1, 2, 3], 1, params).result(10))
    assert len(resp.sequences[0].tokens) == 8
    assert rlengine_sim_engine.config.backend == "sim"
    seen["sim"] = rlengine_sim_engine


def test_factory_takes_overrides(rlengine_engine):
    short = rlengine_engine("sim", sim={"gen_len": 3}, seed=7)
    other = rlengine_engine(sim=rle.SimConfig(gen_len=5))
    assert short is not other and short.state == other.state == "running"
    assert short.config.seed == 7
    resp = short.sampling_client().sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=8)).result(10)
    assert len(resp.sequences[0].tokens) == 3
    resp = other.sampling_client().sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=8)).result(10)
    assert len(resp.sequences[0].tokens) == 5
    seen["factory"] = [short, other]


def test_every_engine_was_closed_at_teardown():
    assert seen["sim"].state == "closed"
    assert [e.state for e in seen["factory"]] == ["closed", "closed"]
"""


def test_a_user_suite_benchmarks_the_sim_engine(pytester: pytest.Pytester):
    pytester.makepyfile(test_user_latency=SIM_SUITE)
    result = _run(pytester, "--benchmark-max-time=0.2", "--benchmark-json=bench.json")
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=3)
    [bench] = json.loads((pytester.path / "bench.json").read_text())["benchmarks"]
    assert bench["name"] == "test_sample_latency"
    assert bench["stats"]["rounds"] >= 1 and bench["stats"]["min"] > 0


SERVE_SUITE = """
import json
import os
import urllib.request

import pytest

from rlengine.protocol import ConnectionLost

seen = {}


def test_a_turn_through_the_served_engine(rlengine_server, rlengine_sandbox_client):
    session_id, token = rlengine_server.open_session()
    session = rlengine_sandbox_client.session(session_id, token)
    reply = session.generate([1, 2, 3], max_tokens=4)
    [choice] = reply.choices
    assert len(choice.tokens) == 4
    [trajectory] = session.trace()
    assert trajectory.tokens == [1, 2, 3] + choice.tokens
    assert rlengine_server.call(rlengine_server.sessions.live) == [session_id]
    session.close()
    assert rlengine_server.call(rlengine_server.sessions.live) == []
    assert rlengine_server.http_url.startswith("http://127.0.0.1:")
    models = urllib.request.Request(rlengine_server.http_url + "/models",
                                    headers={"Authorization": f"Bearer {rlengine_server.api_key}"})
    with urllib.request.urlopen(models, timeout=10) as response:
        assert json.load(response)["data"][0]["id"] == rlengine_server.engine.model_name
    seen.update(engine=rlengine_server.engine, client=rlengine_sandbox_client, path=rlengine_server.ipc_path)


def test_the_serve_factory_takes_configs(rlengine_serve):
    served = rlengine_serve(serve={"http": False}, model_name="sim", sim={"gen_len": 2})
    assert served.http_url is None and served.engine.model_name == "sim"
    session = served.session()
    assert len(session.generate([5, 6], max_tokens=8).choices[0].tokens) == 2
    assert served.connect().ping(b"x") == b"x"
    seen["factory"] = served


def test_everything_was_closed_at_teardown():
    assert seen["engine"].state == "closed"
    assert not os.path.exists(seen["path"])
    with pytest.raises(ConnectionLost):
        seen["client"].ping()
    served = seen["factory"]
    assert served.engine.state == "closed" and served.server.state == "closed"
    assert served.loop.is_closed()
"""


def test_a_user_suite_runs_a_turn_through_the_serve_fixture(pytester: pytest.Pytester):
    pytester.makepyfile(test_user_serve=SERVE_SUITE)
    result = _run(pytester)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=3)


TORCH_SUITE = """
import os

import rlengine as rle


def test_one_short_sample_on_the_tiny_model(rlengine_torch_engine, rlengine_model_cache):
    assert rlengine_torch_engine.backend.name == "torch"
    assert os.path.commonpath([rlengine_torch_engine.model_path, rlengine_model_cache]) == rlengine_model_cache
    sampler = rlengine_torch_engine.sampling_client()
    resp = sampler.sample([1, 2, 3], 1, rle.SamplingParams(max_tokens=4, seed=0)).result(120)
    assert 1 <= len(resp.sequences[0].tokens) <= 4
"""


@pytest.mark.model_plane
@pytest.mark.slow
def test_a_user_suite_samples_the_torch_engine(pytester: pytest.Pytester):
    pytester.makepyfile(test_user_torch=TORCH_SUITE)
    result = _run(pytester)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=1)
