"""rlengine.backends.torch.threads: the one place torch's thread count is decided.

No torch here: the decision is a pure function of the environment and the
CPU count (``tests/backends/test_torch_backend.py`` checks that
``configure_threads`` applies it on a fresh thread).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlengine.backends.torch import threads
from rlengine.errors import ConfigurationError

PACKAGE = Path(__file__).resolve().parents[2] / "rlengine"


@pytest.mark.parametrize("env, cpus, expected", [
    ({}, 2, 1),
    ({}, 4, 1),
    ({}, 16, None),  # a big host keeps torch's own choice
    ({"OMP_NUM_THREADS": "3"}, 2, None),  # the user decided
    ({"RLENGINE_TORCH_THREADS": "2"}, 2, 2),
    ({"RLENGINE_TORCH_THREADS": "8", "OMP_NUM_THREADS": "1"}, 16, 8),  # the override wins
])
def test_the_decision(env, cpus, expected):
    decision = threads.decide(env, cpus)
    assert decision.threads == expected
    assert decision.why  # always says why


@pytest.mark.parametrize("env, cpus, default, expected", [
    ({}, 2, 2, 1),  # a small machine: one thread each for the sampler and the trainer
    ({}, 16, 16, 8),  # a big host: torch's own count, halved
    ({"OMP_NUM_THREADS": "6"}, 16, 6, 3),  # the user's count, halved
    ({"RLENGINE_TORCH_THREADS": "3"}, 16, 16, 3),  # the override applies to each thread
])
def test_training_beside_sampling_splits_the_count_between_the_two_compute_threads(env, cpus, default, expected):
    assert threads.per_thread(threads.decide(env, cpus), 2, default) == expected
    assert threads.per_thread(threads.decide(env, cpus), 1, default) == threads.decide(env, cpus).threads


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_a_bad_override_is_refused(raw):
    with pytest.raises(ConfigurationError, match="RLENGINE_TORCH_THREADS"):
        threads.decide({"RLENGINE_TORCH_THREADS": raw}, 2)


def _without_thread_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RLENGINE_TORCH_THREADS")}


def test_rlengine_info_reports_the_decision_and_sets_nothing():
    code = (
        "import json, os, rlengine.cli as cli\n"
        "cli.main(['info', '--json'])\n"
        "assert 'OMP_NUM_THREADS' not in os.environ, 'the CLI set OMP_NUM_THREADS'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_without_thread_settings(), capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    reported = json.loads(proc.stdout)["torch_threads"]
    expected = threads.decide(_without_thread_settings())
    assert reported == {"threads": expected.threads if expected.threads is not None else "torch's default",
                        "why": expected.why}


def test_no_module_but_the_decision_touches_thread_settings():
    """The CLIs used to set OMP_NUM_THREADS=1 unconditionally (one thread even on a 16-core host).
    Now ``threads`` reads the environment and ``runtime`` applies its decision; nothing else."""
    touching = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and node.value == "OMP_NUM_THREADS") or (
                    isinstance(node, ast.Attribute) and node.attr == "set_num_threads"):
                touching.add(str(path.relative_to(PACKAGE.parent)))
    assert touching == {"rlengine/backends/torch/threads.py", "rlengine/backends/torch/runtime.py"}
