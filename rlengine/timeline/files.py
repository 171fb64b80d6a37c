"""Reading the timeline files of a run directory: each segment's file found, a run's segments
merged into one trace, and the report ``rlengine timeline RUN_DIR`` prints (``rlengine.timeline``
records them and says what a segment is).

Standard library, msgspec and the lower layers only.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import msgspec

from rlengine.errors import ConfigurationError
from rlengine.timeline import PRIORITY, TIMELINE_FILE

__all__ = ["load", "merge", "new_segment", "report", "requests", "segment_files", "segment_path", "steps"]

_LATER_SEGMENT = re.compile(r"timeline-([0-9]+)\.json")


def segment_path(run_dir: str, segment: int) -> str:
    """The timeline file of a run's ``segment``-th part: ``timeline.json`` for the first, then
    ``timeline-<segment>.json`` for each resume."""
    return os.path.join(run_dir, TIMELINE_FILE if segment == 1 else f"timeline-{segment}.json")


def segment_files(run_dir: str) -> list[tuple[int, str]]:
    """The timeline files in ``run_dir``: (segment, path), in segment order."""
    found = []
    for name in os.listdir(run_dir):
        later = _LATER_SEGMENT.fullmatch(name)
        if name == TIMELINE_FILE:
            found.append((1, os.path.join(run_dir, name)))
        elif later is not None and int(later.group(1)) >= 2:
            found.append((int(later.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def new_segment(run_dir: str, resumed_from: int | None) -> int:
    """The segment a run ending in ``run_dir`` writes its timeline as (``segment_path``).

    A resumed run (``resumed_from``: its checkpoint's step, -1 for none) takes the number after the
    last file there. A fresh run (None) is segment 1; the later segments an earlier run left in the
    directory (one that had no ``metrics.jsonl``, or ``rlengine train`` would have refused it) are
    removed, or ``load`` would read them as this run's resumes."""
    files = segment_files(run_dir)
    if resumed_from is not None:
        return files[-1][0] + 1 if files else 1
    for segment, path in files:
        if segment > 1:
            os.remove(path)
    return 1


def load(path: str) -> dict[str, Any]:
    """A trace file written by ``Timeline.write``; of a run directory, its segments' files merged
    (``merge``; one file alone is returned as it is)."""
    if not os.path.isdir(path):
        return _read(path)
    files = segment_files(path)
    if not files:
        raise ConfigurationError(f"timeline={os.path.join(path, TIMELINE_FILE)!r}: no such file "
                                 "(run with timeline=true)")
    if len(files) == 1:
        return _read(files[0][1])
    return merge([_read(p) for _, p in files], [(k, os.path.basename(p)) for k, p in files])


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            document = msgspec.json.decode(f.read())
    except FileNotFoundError:
        raise ConfigurationError(f"timeline={path!r}: no such file (run with timeline=true)") from None
    except msgspec.DecodeError as exc:
        raise ConfigurationError(f"timeline={path!r}: not trace JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ConfigurationError(f"timeline={path!r}: holds no traceEvents list")
    return document


def merge(documents: list[dict[str, Any]], files: list[tuple[int, str]]) -> dict[str, Any]:
    """One trace of a run's segments (``documents``, in order, read from ``files``: (segment, name)).

    Segment k is process k, named for its file and where it resumed, its times moved onto the
    first segment's clock (by the difference of their ``origin_unix_s``). Each step event gets its
    ``segment``; a step that metrics.jsonl no longer holds from that segment (past the checkpoint a
    later segment resumed from: cut back, then re-run) is marked ``superseded``, and ``steps`` leaves
    it out. The events themselves all stay: what a superseded step did still happened."""
    first = documents[0].get("otherData") or {}
    origin = float(first.get("origin_unix_s", 0.0))
    # The last step of each segment that the later ones keep: the lowest checkpoint they resumed from.
    keeps: list[float] = []
    keep = math.inf
    for document in reversed(documents):
        keeps.append(keep)
        resumed_from = (document.get("otherData") or {}).get("resumed_from")
        if isinstance(resumed_from, int):
            keep = min(keep, resumed_from)
    keeps.reverse()
    events: list[dict[str, Any]] = []
    segments = []
    for document, (k, name), kept in zip(documents, files, keeps):
        other = document.get("otherData") or {}
        resumed_from = other.get("resumed_from")
        shift = (float(other.get("origin_unix_s", origin)) - origin) * 1e6  # microseconds, as ts
        where = f", resumed from step {resumed_from}" if isinstance(resumed_from, int) and resumed_from >= 0 else ""
        label = f"rlengine: segment {k} ({name}{where})"
        for event in document["traceEvents"]:
            event = {**event, "pid": k}
            if "ts" in event:
                event["ts"] = round(event["ts"] + shift, 3)
            args = event.get("args")
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {"name": label}
            elif _is_step(event):
                event["args"] = {**args, "segment": k, **({"superseded": True} if args["step"] > kept else {})}
            events.append(event)
        segments.append({"segment": k, "file": name, "resumed_from": resumed_from,
                         **{key: other[key] for key in ("origin_unix_s", "stride", "max_events", "details_seen")
                            if key in other}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "rlengine", "origin_unix_s": origin,
                          "stride": max(int(s.get("stride", 1)) for s in segments), "segments": segments}}


# -- reading a trace: ``rlengine timeline RUN_DIR`` ---------------------------------------------

_PARTS = (*PRIORITY, "idle")


def _is_step(event: dict[str, Any]) -> bool:
    return (event.get("cat") == "step" and event.get("ph") == "X" and isinstance(event.get("args"), dict)
            and "wall_s" in event["args"])


def steps(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps of a trace (``step``'s events), in order, each once: ``step``, ``wall_s`` and a
    ``<part>_s`` per part of ``PRIORITY`` and ``idle`` (and, merged, its ``segment``: of a step
    several segments ran, the latest one's, superseded records left out: ``merge``)."""
    latest: dict[int, dict[str, Any]] = {}
    for event in document["traceEvents"]:
        if _is_step(event) and not event["args"].get("superseded"):
            args = event["args"]
            if args.get("segment", 0) >= latest.get(args["step"], {}).get("segment", 0):
                latest[args["step"]] = args
    return [latest[step] for step in sorted(latest)]


def requests(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests a trace kept (the arguments of each one's outer slice), slowest first."""
    out = [e["args"] for e in document["traceEvents"] if e.get("cat") == "request" and e.get("ph") == "b"
           and isinstance(e.get("args"), dict) and "duration_s" in e["args"]]
    return sorted(out, key=lambda a: -a["duration_s"])


def report(document: dict[str, Any], top: int = 10) -> str:
    """Where each step's time went (seconds and shares of the step) and the ``top`` slowest requests;
    of a merged trace, its segments too, and each step's."""
    lines = []
    other = document.get("otherData") or {}
    stride = other.get("stride", 1)
    kept = "all kept" if stride == 1 else f"1 in {stride} kept"
    lines.append(f"{len(document['traceEvents'])} events (requests, backend jobs, environment turns: {kept})")
    rows = steps(document)
    segments = other.get("segments")
    if segments:
        lines += _segment_lines(document, segments, rows)
    if rows:
        head = f"{'step':>6} {'wall s':>8}" + "".join(f" {p:>17}" for p in _PARTS) + (" segment" if segments else "")
        lines += ["", "where each step's time went (seconds, share of the step):", head]
        totals = dict.fromkeys(("wall_s", *(f"{p}_s" for p in _PARTS)), 0.0)
        for row in rows:
            lines.append(_step_line(str(row["step"]), row) + (f" {row['segment']:>7}" if segments else ""))
            for key in totals:
                totals[key] += float(row.get(key, 0.0))
        lines.append(_step_line("total", totals))
    else:
        lines += ["", "no steps recorded (a server's timeline, or a run that ended before its first step)"]
    slow = requests(document)
    lines += ["", f"slowest requests ({min(top, len(slow))} of {len(slow)} kept):"]
    if slow:
        lines.append(f"{'request':<12} {'session':<20} {'prompt':>7} {'tokens':>7} {'samples':>7} "
                     f"{'queued s':>9} {'total s':>9}  outcome")
        for a in slow[:top]:
            session = a.get("session_id") or "-"
            lines.append(f"{a['request_id']:<12} {session[:20]:<20} {a['prompt_tokens']:>7} {a['tokens']:>7} "
                         f"{a['samples']:>7} {a['queued_s']:>9.4f} {a['duration_s']:>9.4f}  {a['outcome']}")
    return "\n".join(lines)


def _segment_lines(document: dict[str, Any], segments: list[dict[str, Any]],
                   rows: list[dict[str, Any]]) -> list[str]:
    """A merged trace's segments: file, where each resumed, the steps it recorded and those shown from it."""
    recorded: dict[int, list[int]] = {}
    for event in document["traceEvents"]:
        if _is_step(event):
            recorded.setdefault(event["args"].get("segment", 0), []).append(event["args"]["step"])
    lines = ["", (f"{len(segments)} segments (one file each, a trace of its own); a step run again after a resume "
                  "is shown from the later segment, as metrics.jsonl keeps it:")]
    for segment in segments:
        k, resumed_from = segment["segment"], segment.get("resumed_from")
        if not isinstance(resumed_from, int):
            start = "started"
        elif resumed_from < 0:
            start = "resumed, from the start"  # no checkpoint: it kept nothing of the segments before
        else:
            start = f"resumed from step {resumed_from}"
        shown = [row["step"] for row in rows if row.get("segment") == k]
        lines.append(f"  {k:>3}  {segment['file']:<18} {start:<24} steps recorded: "
                     f"{_ranges(recorded.get(k, []))}; shown: {_ranges(shown)}")
    return lines


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``; none as ``-``."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def _step_line(label: str, row: dict[str, Any]) -> str:
    wall = float(row.get("wall_s", 0.0))
    cells = []
    for part in _PARTS:
        value = float(row.get(f"{part}_s", 0.0))
        cells.append(f" {value:>9.3f} ({100 * value / wall if wall else 0:>3.0f}%)")
    return f"{label:>6} {wall:>8.3f}" + "".join(cells)
