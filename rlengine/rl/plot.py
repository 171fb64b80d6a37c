"""The reward-curve PNG of a run: matplotlib when installed, else a small numpy rasteriser.

``write_reward_png(path, train, evals)`` draws the training mean reward per
step (blue) and the held-out evaluations (orange, with dots). With
matplotlib it is an ordinary labelled plot. Without it, the curve is
rasterised here: a white canvas, grey grid lines, black axes, tick labels
in a built-in 3x5 pixel digit font, anti-aliasing skipped; the PNG is
written by hand (RGB, one zlib-compressed IDAT chunk, CRC32 per chunk), as
the PNG specification defines it, so no imaging library is needed.

It must not read run files or decide anything; ``run`` hands it the points.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np

__all__ = ["encode_png", "rasterize", "write_reward_png"]

Points = Sequence[tuple[int, float | None]]

_WIDTH, _HEIGHT = 720, 420
_LEFT, _RIGHT, _TOP, _BOTTOM = 58, 20, 20, 40
_BLUE = (31, 119, 180)
_ORANGE = (255, 127, 14)
_GRID = (225, 225, 225)
_BLACK = (0, 0, 0)

# 3x5 glyphs, rows top to bottom, 3 bits per row (MSB left).
_FONT = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2), "-": (0, 0, 7, 0, 0),
}


def write_reward_png(path: str, train: Points, evals: Points) -> None:
    """Draw the reward curves into ``path`` (PNG)."""
    train = [(s, r) for s, r in train if r is not None and math.isfinite(r)]
    evals = [(s, r) for s, r in evals if r is not None and math.isfinite(r)]
    if importlib.util.find_spec("matplotlib") is not None:
        _matplotlib_png(path, train, evals)
        return
    with open(path, "wb") as f:
        f.write(encode_png(rasterize(train, evals)))


def _matplotlib_png(path: str, train: Points, evals: Points) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(_WIDTH / 100, _HEIGHT / 100), dpi=100)
    if train:
        ax.plot(*zip(*train), color="#1f77b4", label="train reward (mean per step)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="#ff7f0e", label="held-out eval reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(True, color="#e1e1e1")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    span = hi - lo
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    text = f"{value:.2f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:.0f}"
    return "0" if text in ("", "-0") else text


def _text(img: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    """Draw ``text`` with its top-left corner at (x, y)."""
    for ch in text:
        rows = _FONT.get(ch)
        if rows is not None:
            for r, bits in enumerate(rows):
                for c in range(3):
                    if bits & (4 >> c):
                        img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = _BLACK
        x += 4 * scale


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: tuple[int, int, int]) -> None:
    """A 2-pixel-wide segment, sampled densely enough to leave no gaps."""
    n = int(max(abs(x1 - x0), abs(y1 - y0))) * 2 + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    h, w = img.shape[:2]
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        img[np.clip(ys + dy, 0, h - 1), np.clip(xs + dx, 0, w - 1)] = color


def rasterize(train: Points, evals: Points) -> np.ndarray:
    """The plot as an ``(H, W, 3)`` uint8 RGB image."""
    img = np.full((_HEIGHT, _WIDTH, 3), 255, dtype=np.uint8)
    points = [p for p in (*train, *evals)]
    x_lo, x_hi = 0.0, float(max([s for s, _ in points], default=1) or 1)
    ys = [float(r) for _, r in points]
    y_lo, y_hi = min([0.0, *ys]), max([1.0, *ys])
    pad = (y_hi - y_lo) * 0.03
    y_lo, y_hi = y_lo - pad, y_hi + pad
    left, right, top, bottom = _LEFT, _WIDTH - _RIGHT, _TOP, _HEIGHT - _BOTTOM

    def px(step: float, reward: float) -> tuple[float, float]:
        return (left + (step - x_lo) / (x_hi - x_lo) * (right - left),
                bottom - (reward - y_lo) / (y_hi - y_lo) * (bottom - top))

    for value in _ticks(y_lo, y_hi):
        _, y = px(x_lo, value)
        img[round(y), left:right] = _GRID
        label = _label(value)
        _text(img, left - 8 - len(label) * 8, round(y) - 5, label)
    for value in _ticks(x_lo, x_hi):
        x, _ = px(value, y_lo)
        img[top:bottom, round(x)] = _GRID
        label = _label(value)
        _text(img, round(x) - len(label) * 4, bottom + 8, label)
    img[top:bottom + 1, left] = _BLACK
    img[bottom, left:right + 1] = _BLACK
    for series, color, dots in ((train, _BLUE, False), (evals, _ORANGE, True)):
        coords = [px(s, r) for s, r in series]
        for (xa, ya), (xb, yb) in itertools.pairwise(coords):
            _line(img, xa, ya, xb, yb, color)
        if dots or len(coords) == 1:
            for x, y in coords:
                xi, yi = round(x), round(y)
                img[max(yi - 3, 0):yi + 4, max(xi - 3, 0):xi + 4] = color
    return img


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(img: np.ndarray) -> bytes:
    """An RGB ``(H, W, 3)`` uint8 image as PNG bytes (8-bit truecolor, filter type 0 on every row)."""
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"image of shape {img.shape} and dtype {img.dtype}: need (H, W, 3) uint8")
    h, w = img.shape[:2]
    rows = np.concatenate([np.zeros((h, 1), dtype=np.uint8), img.reshape(h, w * 3)], axis=1)
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
            + _chunk(b"IEND", b""))
