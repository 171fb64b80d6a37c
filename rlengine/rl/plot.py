"""The reward curve of a run, drawn with matplotlib.

``reward_figure(steps, evals, title=...)`` builds the figure from the
records of ``metrics.jsonl`` and ``eval.jsonl`` (see ``metrics``): the
training mean reward per step as a line, the 10th-90th percentile of the
step's rewards as a band where the records carry it, and the held-out
evaluations as their own series with markers; a title, the axis labels
(step, reward) and a legend. ``write_reward_png(path, ...)`` saves it as a
720x420 PNG, atomically, so a reader never sees half a file.

matplotlib is imported inside these functions, not at module level:
``rlengine.rl`` is control plane and must stay light to import, and
matplotlib is optional (the ``torch`` extra). Without it they raise
``ImportError``, which ``run`` turns into one log line and no PNG.

This module must not read run files or decide anything; ``run`` hands it
the records. It must not touch pyplot or the process's matplotlib backend:
the figure is a bare ``Figure`` on an Agg canvas, so nothing global is
changed in a program that embeds the engine and no display is needed; it
is in no pyplot registry, so there is nothing to close (it is freed with
its last reference).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlengine.rl.metrics import replace_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["reward_figure", "write_reward_png"]

Records = Sequence[Mapping[str, Any]]

WIDTH_PX, HEIGHT_PX, DPI = 720, 420, 100
DEFAULT_TITLE = "reward per training step"
_BLUE, _ORANGE = "#1f77b4", "#ff7f0e"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(step, value) of the records whose ``key`` is a finite number (a missing figure is null in the logs)."""
    points = [(r["step"], float(r[key])) for r in records if _finite(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def reward_figure(steps: Records, evals: Records, *, title: str | None = None) -> Figure:
    """The reward curves as an unsaved ``Figure`` (``WIDTH_PX`` x ``HEIGHT_PX`` at ``DPI``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # sets itself as fig.canvas: Agg renders it, whatever backend the process uses
    ax = fig.add_subplot()
    band = [(r["step"], float(r["reward_p10"]), float(r["reward_p90"])) for r in steps
            if _finite(r.get("reward_mean")) and _finite(r.get("reward_p10")) and _finite(r.get("reward_p90"))]
    if band:
        xs, lo, hi = zip(*band)
        ax.fill_between(xs, lo, hi, color=_BLUE, alpha=0.15, linewidth=0, label="train reward, 10th-90th percentile")
    xs, ys = _series(steps, "reward_mean")
    if xs:
        # One point makes no line; the marker keeps a one-step run visible.
        ax.plot(xs, ys, color=_BLUE, marker="o" if len(xs) == 1 else None, label="train reward (mean per step)")
    xs, ys = _series(evals, "reward_mean")
    if xs:
        ax.plot(xs, ys, "o-", color=_ORANGE, label="held-out eval reward (mean)")
    ax.set_title(title or DEFAULT_TITLE)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(True, color="#e1e1e1")
    # legend() with nothing labelled warns; a run whose every reward was null has nothing to name.
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    return fig


def write_reward_png(path: str, steps: Records, evals: Records, *, title: str | None = None) -> None:
    """Draw the reward curves into ``path`` (PNG), replacing it atomically."""
    png = io.BytesIO()
    reward_figure(steps, evals, title=title).savefig(png, format="png", dpi=DPI)
    replace_file(path, png.getvalue())
