"""A training run's progress as ``rlengine train`` shows it: a bar on a terminal, plain lines elsewhere.

``Progress`` takes the run's callbacks (``on_start``, ``on_step``, ``on_eval`` of
``rlengine.rl.run.train``) and writes to stderr:

* on a terminal, a tqdm bar over the steps (``starting`` until the first step);
* anywhere else (a log file, CI, a pipe), one plain line when the run starts, one at the
  first step, then at most one every ``every_s`` seconds, and one at the last step, flushed
  as written, so a log shows where a run is while it runs.

Both show the same figures: the step, the mean reward, the time per step, an estimate of
the time left, the sampler-trainer KL (k3), failed attempts and the last held-out
evaluation. The time per step is the mean of the last few steps' own ``step_time_s``
(``metrics.jsonl``), which starts when the loop does: the engine's start-up, the model
build and the first weight install are not a step, and a resumed run's earlier steps
were not timed here.

It formats and writes; the figures come from the records the run hands over.
"""

from __future__ import annotations

import collections
import importlib.util
import math
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, TextIO

__all__ = ["Progress", "failures", "shown"]

Mode = Literal["bar", "lines", "off"]


class Progress:
    """The run's progress on ``stream``; see the module docstring."""

    WINDOW = 5
    """Steps the time per step is averaged over."""

    def __init__(self, mode: Mode, *, every_s: float = 5.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self.every_s = every_s
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.total: int | None = None
        self.eval: float | None = None
        self.bar: Any = None
        self._recent: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._last_line: float | None = None

    @classmethod
    def for_stream(cls, enabled: bool, stream: TextIO | None = None, every_s: float = 5.0) -> Progress:
        """A bar where ``stream`` (stderr) is a terminal, plain lines elsewhere, nothing when not ``enabled``."""
        stream = stream if stream is not None else sys.stderr
        # A terminal without tqdm (a base install) gets the plain lines.
        bar = stream.isatty() and importlib.util.find_spec("tqdm") is not None
        mode: Mode = "off" if not enabled else "bar" if bar else "lines"
        return cls(mode, every_s=every_s, stream=stream)

    # -- the run's callbacks ---------------------------------------------------------------

    def start(self, config: Any, total: int) -> None:
        self.total = total
        if self.mode == "bar":
            from tqdm import tqdm

            # ``disable=False``: a TQDM_DISABLE that quiets other bars must not quiet this one.
            self.bar = tqdm(total=total, desc="starting", unit="step", file=self.stream, dynamic_ncols=True,
                            disable=False, bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}")
        elif self.mode == "lines":
            self._write(f"rlengine train: starting, {total} steps")

    def step(self, record: dict[str, Any]) -> None:
        if record.get("step_time_s") is not None:
            self._recent.append(record["step_time_s"])
        step = record["step"]
        if self.bar is not None:
            self.bar.set_description_str("train", refresh=False)
            self.bar.n = step
            self.bar.set_postfix_str(self.figures(record), refresh=False)
            self.bar.refresh()
        elif self.mode == "lines":
            now = self.clock()
            if self._last_line is None or now - self._last_line >= self.every_s or step == self.total:
                self._last_line = now
                self._write(f"rlengine train: step {step}/{self.total}, {self.figures(record)}")

    def evaluation(self, record: dict[str, Any]) -> None:
        self.eval = record.get("reward_mean")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # -- what is shown ---------------------------------------------------------------------

    def seconds_per_step(self) -> float | None:
        """The mean time of the last ``WINDOW`` steps (None before the first)."""
        return sum(self._recent) / len(self._recent) if self._recent else None

    def figures(self, record: dict[str, Any]) -> str:
        """``reward 0.412, 0.85 s/step, 1 min left, kl 1.2e-08, failed 2 (crash 2), eval 0.300``."""
        parts = [f"reward {shown(record.get('reward_mean'))}"]
        per_step = self.seconds_per_step()
        if per_step is not None:
            parts.append(f"{per_step:.2f} s/step")
            if self.total is not None and record["step"] < self.total:
                parts.append(f"{_duration(per_step * (self.total - record['step']))} left")
        if record.get("kl_sample_train_k3") is not None:
            parts.append(f"kl {record['kl_sample_train_k3']:.1e}")
        if record.get("attempts_failed"):
            parts.append(f"failed {failures(record)}")
        if self.eval is not None:
            parts.append(f"eval {shown(self.eval)}")
        return ", ".join(parts)

    def _write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def shown(value: Any, digits: int = 3) -> str:
    """A figure as shown: ``digits`` decimals, ``n/a`` where there is none (a step whose every attempt
    failed has no mean reward: NaN in its record)."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "<1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def failures(record: dict[str, Any]) -> str:
    """Failed attempts, with their kinds: ``3 (crash 2, timeout 1)``."""
    from rlengine.rl.types import FAILURE_KINDS

    kinds = [f"{kind} {record[f'attempts_failed_{kind}']}" for kind in FAILURE_KINDS
             if record.get(f"attempts_failed_{kind}")]
    return f"{record.get('attempts_failed', 0)}" + (f" ({', '.join(kinds)})" if kinds else "")
