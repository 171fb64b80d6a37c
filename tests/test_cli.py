"""The ``rlengine`` command: ``info`` reports backends honestly; ``bench`` prints its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlengine import cli


@pytest.mark.model_plane
def test_info_json_lists_backends_with_reasons(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backends"]["sim"]["available"] is True
    for name in ("torch", "vllm"):
        entry = data["backends"][name]
        assert isinstance(entry["available"], bool) and entry["why"]
    assert "msgspec" in data["packages"]
    assert data["extensions"]["trie"] == "c"
    assert data["auto_backend"]["backend"] in ("vllm", "torch") and data["auto_backend"]["why"]


def test_info_reports_the_reference_trie_when_extensions_are_off():
    env = {**os.environ, "RLENGINE_NO_EXTENSIONS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", "info", "--json"], check=False, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["extensions"]["trie"] == "python-reference"


@pytest.mark.model_plane
def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backends:" in out and "sim" in out
    assert "batch-invariant kernels: ok (" in out and "fixed shapes of the tiny model" in out


@pytest.mark.model_plane
def test_info_reports_the_kernel_check_with_the_cpu_capability_in_force():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", "info", "--json"], check=False, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    check = json.loads(proc.stdout)["batch_invariance"]
    assert check["checked"] and check["ok"] and check["cpu_capability"] == "DEFAULT", check


def test_console_script_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", "info"], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rlengine" in proc.stdout


def test_bench_table_from_results(monkeypatch, capsys):
    fake = {
        "control_plane_overhead": {"overhead_us_per_request": 9.5, "n_requests": 1000, "engine_ms": 30.0,
                                   "direct_backend_ms": 20.5},
        "continuous_vs_wave": {"latency_ratio_wave_over_continuous": 4.2, "agents": 64, "turns": 8, "wave_mean_turn_ms": 300.0,
                               "continuous_mean_turn_ms": 71.0, "makespan_ratio_wave_over_continuous": 2.0,
                               "wave_makespan_s": 2.4, "continuous_makespan_s": 1.2},
    }
    import rlengine.workloads

    monkeypatch.setattr(rlengine.workloads, "run_all", lambda: fake)
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "9.5 us" in out and "4.20x" in out and "2.00x" in out
    assert cli.main(["bench", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == fake


def test_benchmark_workloads_run_small():
    from rlengine.workloads import continuous_vs_wave, control_plane_overhead

    o = control_plane_overhead(n_requests=50, gen_len=4, rounds=1)
    assert o["n_requests"] == 50 and o["engine_ms"] > 0 and o["direct_backend_ms"] > 0
    assert not [k for k in o if k.startswith("target")]  # pass/fail targets live in bench/
    w = continuous_vs_wave(n_agents=4, n_turns=2, step_time_s=0.0005)
    assert w["continuous_mean_turn_ms"] > 0 and w["wave_mean_turn_ms"] > 0


def test_control_plane_never_imports_torch():
    code = (
        "import sys, rlengine as rle\n"
        "with rle.Engine(rle.EngineConfig(backend='sim')) as e:\n"
        "    t = e.training_client(); s = t.save_weights_and_get_sampling_client(timeout=30)\n"
        "    s.sample([1, 2], 2, rle.SamplingParams(max_tokens=3)).result(30)\n"
        "import rlengine.cli; rlengine.cli.info()\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
