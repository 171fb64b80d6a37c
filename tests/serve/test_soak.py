"""The soak under faults, short (``bench/test_soak.py`` runs it for minutes): sessions over IPC and
HTTP while weights install every second and a fault injector kills agents mid-stream, crashes
sandboxes, sends partial frames and stalls readers, then the backend raises. Nothing may be lost,
no install refused beyond the write-off bound, every session settled (``tests.soak``)."""

from __future__ import annotations

import pytest
from soak import FAULTS, run_soak


@pytest.mark.slow
def test_a_short_soak_under_every_fault_loses_nothing():
    report = run_soak(seed=1, ipc_agents=2, http_agents=2, warmup_s=2.0, clean_s=3.0, faults_s=12.0,
                      fault_every_s=0.6)
    assert report.problems == [], report.as_dict()
    assert set(FAULTS) <= set(report.faults), report.faults  # the seed draws every kind in 12 s
    assert report.turns_ok > 50 and report.installs >= 5, report.as_dict()
    assert report.dead_engine_turns == 4
    # Memory: only a gross leak is asserted here (a short run's RSS is noisy); bench/test_soak.py
    # records the drift over minutes.
    assert report.rss_last_mb < report.rss_first_mb * 1.5 + 50, report.as_dict()
