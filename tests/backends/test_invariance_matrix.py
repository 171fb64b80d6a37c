"""The bitwise tests under adversarial kernels, at every CPU capability level and at 1 and 2 threads.

Each cell is a subprocess (``ATEN_CPU_CAPABILITY`` must be set before torch is
imported) running the tests marked ``bitwise`` with
``RLENGINE_ADVERSARIAL_KERNELS=1`` (``tests/adversarial.py``: every GEMM and
attention call perturbed by a function of its shape; the real kernels still
run underneath, so their own rounding by shape, CPU and thread count is in
play too) and ``RLENGINE_TORCH_THREADS`` set to the cell's thread count: the
backend's bitwise tests in every cell, the whole seed-identical RL runs
(tests/rl) in the default level's one-thread cell. A level the CPU lacks
falls back inside torch; such a cell asserts the fallback (to the best level
this CPU has, which its own cell covers) rather than skip.

CI runs every level at one thread and the CPU's own level at two threads
(MKL and oneDNN choose their kernels by thread count and CPU, not by
``ATEN_CPU_CAPABILITY``, so that cell covers the two-thread kernels CI's
machine really has). The other levels' two-thread cells take about five
minutes together on 2 vCPUs and are marked ``long`` (``pytest -m long``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model_plane  # the tiny model or its tokenizer: left out of a light install

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ("default", "avx2", "avx512")
CELL_TIMEOUT_S = 900


def _level_in_force(level: str) -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env={**os.environ, "ATEN_CPU_CAPABILITY": level}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().lower()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def _native_level() -> str:
    """The best level this CPU has, from its flags (torch is not imported here: a light install lacks it)."""
    return "avx512" if "avx512f" in _cpu_flags() else "avx2"


def _cells() -> list:
    native = _native_level()
    return [pytest.param(level, threads, id=f"{level}-{threads}",
                         marks=() if threads == 1 or level == native else pytest.mark.long)
            for level in LEVELS for threads in (1, 2)]


def _run_bitwise(level: str, threads: int, paths: list[str]) -> str:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "RLENGINE_TORCH_THREADS": str(threads),
           "RLENGINE_ADVERSARIAL_KERNELS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "bitwise", *paths],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CELL_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("level", "threads"), _cells())
def test_the_bitwise_tests_hold_under_adversarial_kernels(level, threads):
    in_force = _level_in_force(level)
    if in_force != level:
        # torch falls back to the best level the CPU has: only AVX-512 can be missing on x86.
        assert level == "avx512" and "avx512f" not in _cpu_flags(), (level, in_force)
        assert in_force == "avx2"
        return
    paths = ["tests/backends", "tests/rl"] if (level, threads) == ("default", 1) else ["tests/backends"]
    out = _run_bitwise(level, threads, paths)
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= 15 and "failed" not in out, out[-2000:]
