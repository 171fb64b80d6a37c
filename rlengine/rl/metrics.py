"""What a run writes about itself: JSON lines, optional trackers, the summary.

The run directory holds

* ``metrics.jsonl`` - one line per training step: ``step`` and
  ``reward_mean`` always, then the reward distribution, sampler-vs-trainer
  logprob KL, staleness, tokens/s sampled and trained, step time, the
  sampler's idle share, the process's memory (``memory_metrics``), dropped
  and re-sampled groups, failed attempts, loss, entropy, grad norm and the
  environments' own metrics (``env/<name>``);
* ``eval.jsonl`` - one line per evaluation on the held-out split (``step``,
  ``reward_mean``, ...);
* ``groups.jsonl`` - the group ledger: one line per group the training loop
  consumed or sent back (``step``, ``group`` index, ``attempt``,
  ``disposition``, rewards, failures with the environment's metadata);
* ``reward.png`` - the reward curve, written at the end.

Every line is flushed as it is written, so a killed run loses at most a torn
last line (``checkpoint.rewind_jsonl`` drops it on resume). TensorBoard is
written when ``tensorboard`` (and torch) are installed; Weights & Biases
when ``wandb`` is installed and ``TrainConfig.wandb_project`` is set.

This module must not compute training quantities; it records them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import IO, Any

import msgspec
import numpy as np

from rlengine.rl.types import FAILURE_KINDS

try:
    import resource
except ImportError:  # pragma: no cover - Windows has no getrusage
    resource = None  # type: ignore[assignment]

__all__ = ["MEASURED", "RunLog", "measured", "memory_metrics", "replace_file", "reward_stats", "summarize"]

MEASURED = frozenset({
    "time_s", "step_time_s", "train_time_s", "eval_time_s", "sampler_idle_frac", "trainer_busy_frac",
    "tokens_per_s", "tokens_trained_per_s", "rss_bytes", "rss_peak_bytes", "device_memory_peak_bytes",
    "teacher_score_s", "teacher_score_frac", "teacher_bytes",
    "spec_drafted_tokens", "spec_accepted_tokens", "spec_acceptance",
})
"""The metrics columns that measure the machine (time, memory, and speculative rollout's drafts,
whose choice follows measured step costs) rather than the run: the only ones two runs of one
seed may differ in (``measured`` leaves them out)."""


def measured(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without its ``MEASURED`` columns: what a run of the same seed must reproduce."""
    return {k: v for k, v in row.items() if k not in MEASURED}


METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
GROUPS_FILE = "groups.jsonl"
CONFIG_FILE = "config.json"
ENGINE_FILE = "engine.json"
"""What ran the run: its backend and the backend's capabilities (batch invariance and the
kernel check among them); written when the engine has started, again on each resume."""

_encoder = msgspec.json.Encoder()


def replace_file(path: str, data: bytes) -> None:
    """Write ``data`` as ``path``, atomically: a reader (or a resumed run) sees the old file or the new one.

    It goes into a hidden temporary file beside ``path`` (same directory, so the
    rename stays on one filesystem; ``open`` keeps the umask's permissions), is
    synced, and is renamed over ``path``; on any failure the temporary file is removed.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def memory_metrics() -> dict[str, int]:
    """The process's memory now, for a step's metrics line.

    * ``rss_bytes`` - resident now (``/proc/self/statm``; absent where there is no ``/proc``);
    * ``rss_peak_bytes`` - the most it has been resident so far (``getrusage``);
    * ``device_memory_peak_bytes`` - where torch has CUDA in use (absent otherwise): the most torch
      allocated on any device since the last call (``torch.cuda.max_memory_allocated``, whose peak
      is then reset), so each step's line holds that step's peak. torch is never imported here: it
      counts only when a backend or trainer already did.
    """
    out: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm", "rb") as f:
        out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if resource is not None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB
        # Linux's counters lag by up to a few dozen pages: a peak never reads below the RSS just read.
        out["rss_peak_bytes"] = max(peak, out.get("rss_bytes", 0))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        peaks = []
        for device in range(torch.cuda.device_count()):
            peak = torch.cuda.max_memory_allocated(device)
            if peak:  # a device this process never allocated on is left alone
                peaks.append(peak)
                torch.cuda.reset_peak_memory_stats(device)
        if peaks:
            out["device_memory_peak_bytes"] = max(peaks)
    return out


def reward_stats(rewards: list[float], prefix: str = "reward") -> dict[str, float]:
    """Mean, std, min, max and the 10/50/90th percentiles of ``rewards``."""
    if not rewards:
        return {f"{prefix}_mean": float("nan")}
    r = np.asarray(rewards, dtype=np.float64)
    p10, p50, p90 = np.percentile(r, [10, 50, 90])
    return {f"{prefix}_mean": float(r.mean()), f"{prefix}_std": float(r.std()), f"{prefix}_min": float(r.min()),
            f"{prefix}_max": float(r.max()), f"{prefix}_p10": float(p10), f"{prefix}_p50": float(p50),
            f"{prefix}_p90": float(p90)}


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: a missing figure is null.
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in record.items()}


class RunLog:
    """Appends records to the run directory's JSON-lines files and the optional trackers."""

    def __init__(self, run_dir: str, config: dict[str, Any], wandb_project: str | None) -> None:
        self.run_dir = run_dir
        self.metrics_path = os.path.join(run_dir, METRICS_FILE)
        self.eval_path = os.path.join(run_dir, EVAL_FILE)
        self.groups_path = os.path.join(run_dir, GROUPS_FILE)
        self._files: dict[str, IO[bytes]] = {}
        self._tb: Any = None
        self._wandb: Any = None
        if importlib.util.find_spec("tensorboard") is not None and importlib.util.find_spec("torch") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb_project and importlib.util.find_spec("wandb") is not None:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=run_dir, config=config,
                                     name=os.path.basename(os.path.abspath(run_dir)), resume="allow")

    def _append(self, path: str, record: dict[str, Any]) -> None:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "ab")  # noqa: SIM115 - closed in close()
        f.write(_encoder.encode(_clean(record)) + b"\n")
        f.flush()

    def step(self, record: dict[str, Any]) -> None:
        self._append(self.metrics_path, record)
        self._track(record, "train")

    def evaluation(self, record: dict[str, Any]) -> None:
        self._append(self.eval_path, record)
        self._track(record, "eval")

    def groups(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._append(self.groups_path, record)

    def _track(self, record: dict[str, Any], prefix: str) -> None:
        step = record["step"]
        numbers = {f"{prefix}/{k}": v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, "rb") as f:
        for line in f:
            try:
                out.append(msgspec.json.decode(line))
            except msgspec.DecodeError:
                continue
    return out


def summarize(run_dir: str, target: float) -> dict[str, Any]:
    """The run's figures from its files: rewards first and last, time and steps to ``target``, evaluations."""
    steps = read_jsonl(os.path.join(run_dir, METRICS_FILE))
    evals = read_jsonl(os.path.join(run_dir, EVAL_FILE))
    out: dict[str, Any] = {"steps": len(steps), "target_reward": target}
    if not steps:
        return out
    rewards = [s["reward_mean"] for s in steps if s.get("reward_mean") is not None]
    out["first_reward_mean"] = rewards[0] if rewards else None
    tail = rewards[-5:]
    out["last_reward_mean"] = float(np.mean(tail)) if tail else None
    reached = next((s for s in steps if s.get("reward_mean") is not None and s["reward_mean"] >= target), None)
    out["step_to_target"] = reached["step"] if reached else None
    out["time_to_target_s"] = reached["time_s"] if reached else None
    out["time_s"] = steps[-1].get("time_s")
    for key in ("groups_dropped_constant_reward", "groups_dropped_too_few_survivors", "groups_dropped_overlong",
                "groups_resampled_stale", "groups_resampled_constant", "attempts_overlong_filtered",
                "attempts_failed", *(f"attempts_failed_{kind}" for kind in FAILURE_KINDS)):
        out[key] = int(sum(s.get(key) or 0 for s in steps))
    for key in ("sampler_idle_frac", "trainer_busy_frac"):
        shares = [s[key] for s in steps if s.get(key) is not None]
        out[f"{key}_median"] = float(np.median(shares)) if shares else None
    if evals:
        out["eval_reward_last"] = evals[-1].get("reward_mean")
        scored = [e["reward_mean"] for e in evals if e.get("reward_mean") is not None]
        out["eval_reward_best"] = max(scored) if scored else None  # never -inf: no evaluation scored
    return out
