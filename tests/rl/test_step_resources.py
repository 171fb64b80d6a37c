"""Memory and throughput in every step's metrics line (``rlengine.rl.metrics.memory_metrics``).

A short run of the sim recipe writes, per step, the process's resident
memory and its peak, and the token rates: sampled tokens per second of the
step and trained tokens per second of its training phase, each equal to the
step's own counts divided by its own times. Device memory is absent without
CUDA; where torch has CUDA in use it is each step's peak, read from the
allocator of every device the process allocated on and then reset. With
speculative rollout each step reports the tokens drafted and accepted, and the
rest of its line is bitwise the same run without it.
"""

from __future__ import annotations

import sys
import types

import pytest

from rlengine.errors import ConfigurationError
from rlengine.rl.metrics import measured, memory_metrics, read_jsonl
from rlengine.rl.run import train


def test_every_step_records_its_memory_and_its_token_rates(tmp_path):
    outcome = train("rl_sim:RECIPE", {"batches": "3", "gen_len": "6"}, run_dir=str(tmp_path))
    assert outcome.error is None, outcome.error
    rows = read_jsonl(outcome.metrics_path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert 0 < row["rss_bytes"] <= row["rss_peak_bytes"] < 1 << 40
        assert "device_memory_peak_bytes" not in row  # no CUDA here
        assert row["tokens_sampled"] > 0 and row["sampled_tokens_trained"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["tokens_sampled"] / row["step_time_s"], rel=1e-9)
        assert row["tokens_trained_per_s"] == pytest.approx(row["sampled_tokens_trained"] / row["train_time_s"],
                                                            rel=1e-9)


class _FakeCuda:
    """What ``memory_metrics`` reads of ``torch.cuda``: three devices, the middle one never used."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized
        self.peaks = [5 << 20, 0, 7 << 20]
        self.resets: list[int] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.peaks)

    def max_memory_allocated(self, device: int) -> int:
        return self.peaks[device]

    def reset_peak_memory_stats(self, device: int) -> None:
        self.resets.append(device)
        self.peaks[device] = 0


def test_device_memory_is_each_steps_peak_where_cuda_is_in_use(monkeypatch):
    cuda = _FakeCuda(initialized=True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert memory_metrics()["device_memory_peak_bytes"] == 7 << 20
    assert cuda.resets == [0, 2]  # a device the process never allocated on is not touched
    cuda.peaks[0] = 3 << 20  # the next step's peak, after the reset
    assert memory_metrics()["device_memory_peak_bytes"] == 3 << 20
    idle = _FakeCuda(initialized=False)  # torch loaded, CUDA never used: no device column
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=idle))
    assert "device_memory_peak_bytes" not in memory_metrics() and idle.resets == []


@pytest.mark.model_plane  # the copy recipe's tiny model on the torch backend
def test_speculative_rollout_reports_its_drafts_and_leaves_the_run_unchanged(tmp_path):
    """``speculative_k`` on the copy recipe (torch backend, reproducible): each step reports what it
    drafted and accepted, and every other column (rewards, losses, the sampled data's statistics) is
    bitwise that of the same seed without it."""
    settings = {"steps": "2", "groups_per_batch": "4", "group_size": "4", "eval_every": "0", "checkpoint_every": "0",
                "backend": "torch"}
    plain = train("copy", settings, run_dir=str(tmp_path / "plain"))
    spec = train("copy", {**settings, "speculative_k": "4"}, run_dir=str(tmp_path / "spec"))
    plain_rows, spec_rows = read_jsonl(plain.metrics_path), read_jsonl(spec.metrics_path)
    assert [measured(r) for r in spec_rows] == [measured(r) for r in plain_rows]
    assert all("spec_drafted_tokens" not in r for r in plain_rows)
    drafted = [r.get("spec_drafted_tokens", 0) for r in spec_rows]
    assert sum(drafted) > 0, spec_rows
    for r in spec_rows:
        if "spec_drafted_tokens" in r:
            assert 0 <= r["spec_accepted_tokens"] <= r["spec_drafted_tokens"]
            assert r["spec_acceptance"] == r["spec_accepted_tokens"] / r["spec_drafted_tokens"]


def test_speculative_rollout_needs_the_torch_backend(tmp_path):
    with pytest.raises(ConfigurationError, match=r"^speculative_k=4: .*torch"):
        train("rl_sim:RECIPE", {"batches": "1", "speculative_k": "4"}, run_dir=str(tmp_path))
