"""The timeline (``rlengine.timeline``): what a short run records, the trace-event format Perfetto
opens, the step breakdown against the metrics, the size cap, off records nothing, the
``rlengine timeline`` report, a resumed run's segments and the OpenTelemetry spans.

The runs are real: ``rlengine.rl.run.train`` on the sim recipe of ``tests/rl_sim.py`` (engine,
sampler loop, gate, trainer and environments all running), and ``rlengine timeline`` as a
subprocess. The server's endpoint is tested in ``tests/serve/test_timeline_endpoint.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from collections import defaultdict
from typing import Any

import pytest
import rl_sim

from rlengine import EngineConfig, SamplingParams
from rlengine.core.engine import Engine
from rlengine.core.records import SampleRequest, SampleSpec, Sequence, new_sample
from rlengine.core.scheduler import Scheduler
from rlengine.errors import ConfigurationError
from rlengine.rl.metrics import read_jsonl
from rlengine.rl.run import train
from rlengine.timeline import PRIORITY, TIMELINE_FILE, Timeline, breakdown
from rlengine.timeline.files import load, merge, new_segment, segment_path
from rlengine.timeline.files import steps as step_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = (*PRIORITY, "idle")
# A short multi-turn run whose environments take time: every part of a step shows (typically 1.5 s).
RUN = {"steps": 3, "turns": 2, "env_delay_s": 0.01, "step_time_s": 0.001, "checkpoint_every": 0}


def run(path: Any, **settings: Any) -> dict[str, Any]:
    rl_sim.reset()
    outcome = train("rl_sim:RECIPE", {k: str(v) for k, v in {**RUN, **settings}.items()}, run_dir=str(path))
    assert outcome.error is None, outcome.error
    return load(str(path)) if settings.get("timeline") else {}


def settled(request_id: str, submitted: float, admitted: float, tokens: int = 4,
            session_id: str | None = None) -> SampleRequest:
    """A sample call's record as the sampler loop settles it: leased at version 0, one sequence."""
    record = new_sample(request_id, SampleSpec(array("i", [1, 2, 3]).tobytes(), 1, SamplingParams(), False), None,
                        session_id, None, lambda _: None)
    scheduler = Scheduler(version=0)
    scheduler.submit(record)
    record.lease = scheduler.admit().leases[0]
    record.submitted_at, record.admitted_at = submitted, admitted
    record.seqs = [Sequence(record, 0, request_id, 0, tokens=array("i", range(tokens)))]
    return record


def check_format(document: dict[str, Any]) -> None:
    """What Chrome's trace-event format (and Perfetto's importer) expects of every event."""
    events = document["traceEvents"]
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    last_ts: dict[tuple[int, int], float] = {}
    for e in events:
        assert e["ph"] in ("M", "X", "i", "b", "e"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            continue
        assert e["tid"] in named, e  # every track is named by a metadata event
        assert isinstance(e["ts"], (int, float)) and isinstance(e["name"], str) and isinstance(e["cat"], str), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        if e["ph"] in ("b", "e"):
            assert isinstance(e["id"], str), e
        key = (e["pid"], e["tid"])
        assert e["ts"] >= last_ts.get(key, float("-inf")), f"ts goes back on track {key}: {e}"
        last_ts[key] = e["ts"]


def async_slices(document: dict[str, Any], cat: str) -> dict[str, list[dict[str, Any]]]:
    """Per id, the begin/end events of category ``cat`` in file order."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in document["traceEvents"]:
        if e.get("cat") == cat and e["ph"] in ("b", "e"):
            out[e["id"]].append(e)
    return out


@pytest.mark.model_plane
def test_a_short_run_records_every_request_and_step_in_order(tmp_path):
    document = run(tmp_path, timeline=True)
    json.loads((tmp_path / TIMELINE_FILE).read_text())  # plain JSON, as any viewer reads it
    check_format(document)
    seen = document["otherData"]["details_seen"]
    assert document["otherData"]["stride"] == 1

    # Every request: a balanced, properly nested set of slices, times never going back.
    requests = async_slices(document, "request")
    assert len(requests) == seen["requests"] > 0
    for rid, events in requests.items():
        assert [e["ts"] for e in events] == sorted(e["ts"] for e in events), rid
        depth = 0
        for e in events:
            depth += 1 if e["ph"] == "b" else -1
            assert depth >= 0, rid
        assert depth == 0 and events[0]["name"] == events[-1]["name"] == f"request {rid}", rid
        args = events[0]["args"]
        assert args["tokens"] > 0 and args["prompt_tokens"] > 0 and args["outcome"] == "completed", args
        assert args["versions"], args  # the policy versions that produced its tokens
        assert {e["name"] for e in events} >= {"queued", "running"}

    # Every step of the metrics, its breakdown summing to the step's time, which is the metrics line's.
    metrics = read_jsonl(str(tmp_path / "metrics.jsonl"))
    steps = [e for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] == "step" and "wall_s" in
             e.get("args", {})]
    assert [s["args"]["step"] for s in steps] == [m["step"] for m in metrics] == [1, 2, 3]
    for step, line in zip(steps, metrics):
        a = step["args"]
        assert sum(a[f"{p}_s"] for p in PARTS) == pytest.approx(a["wall_s"], rel=1e-9)
        assert a["wall_s"] == pytest.approx(line["step_time_s"], rel=0.02)
        assert step["dur"] == pytest.approx(a["wall_s"] * 1e6, abs=1.0)
        assert a["environment_s"] > 0 and a["sampling_s"] > 0, a  # 10 ms env steps, sim backend steps
    assert sum(s["args"]["training_s"] + s["args"]["install_s"] for s in steps) > 0

    names = {e["name"] for e in document["traceEvents"]}
    assert {"forward_backward", "optim_step", "install", "seal", "drain", "reopen", "decode", "env step",
            "initial observation", "gather", "train"} <= names, names
    envs = async_slices(document, "environment")
    assert len(envs) == seen["environment"] > 0
    assert all(len(v) == 2 and v[0]["ts"] <= v[1]["ts"] for v in envs.values())


@pytest.mark.model_plane
def test_a_run_without_a_timeline_writes_none_and_an_engine_without_one_records_nothing(tmp_path):
    run(tmp_path, steps=1)
    assert not (tmp_path / TIMELINE_FILE).exists()
    timeline = Timeline()
    with Engine(EngineConfig(backend="sim"), timeline=timeline) as engine:
        engine.sample([1, 2, 3], 2, SamplingParams(max_tokens=4)).result(30)
        # A streamed request reports its first token before it ends: its prefill shows.
        engine.sample([1, 2, 3], 1, SamplingParams(max_tokens=4), on_tokens=lambda *_: None).result(30)
        recorded = len(timeline)
        slices = async_slices(timeline.document(), "request")
        assert [e["name"] for e in slices["s1"]] == ["request s1", "queued", "queued", "running", "running",
                                                     "request s1"]
        assert [e["name"] for e in slices["s2"]][3:7] == ["prefill", "prefill", "decode", "decode"]
        engine.timeline = None  # off: the sampler checks one attribute and records nothing
        engine.sample([1, 2, 3], 2, SamplingParams(max_tokens=4)).result(30)
        engine.training_client().save_weights_for_sampler().result(30)
        assert len(timeline) == recorded


def test_the_cap_thins_details_evenly_and_keeps_every_step():
    timeline = Timeline(max_events=400)
    track = timeline.track("compute")
    timeline.start_steps()
    for step in range(60):
        t = float(step)
        for r in range(50):
            timeline.request(track, settled(f"s{step}-{r}", t, t + 0.1), "completed", t + 0.5)
            timeline.job(track, t + 0.1, t + 0.2, 4, 1, 1, 1)
        timeline.step(step + 1, t, t + 1.0)
    events = timeline.events()
    assert len(events) <= 400 and len(timeline) <= 400
    assert sorted(e["args"]["step"] for e in events if e.get("cat") == "step") == list(range(1, 61))
    stride = timeline.stride
    assert stride > 1
    kept = [e["args"]["request_id"] for e in events if e["ph"] == "b" and e.get("cat") == "request"
            and "request_id" in e.get("args", {})]
    numbers = [int(k.split("-")[0][1:]) * 50 + int(k.split("-")[1]) for k in kept]
    assert numbers and all(n % stride == 0 for n in numbers)
    assert min(numbers) < 300 and max(numbers) > 2700  # an even sample: the run's start and its end
    # The breakdown is kept apart from the sampled details: every step still has its sampling time.
    assert all(e["args"]["sampling_s"] == pytest.approx(0.1) for e in events if e.get("cat") == "step")


def test_breakdown_gives_overlaps_to_the_higher_part_and_the_rest_to_idle():
    work = [("environment", 0.0, 4.0), ("sampling", 1.0, 2.0), ("training", 1.5, 3.0), ("install", 2.5, 2.75),
            ("sampling", 9.0, 12.0)]
    parts = breakdown(work, 0.0, 10.0)
    assert parts == pytest.approx({"install": 0.25, "training": 1.25, "sampling": 0.5 + 1.0, "environment": 2.0,
                                   "idle": 5.0})
    assert sum(parts.values()) == pytest.approx(10.0)


def test_a_bad_cap_is_refused_naming_the_setting():
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ConfigurationError, match="timeline_max_events"):
            Timeline(bad)


@pytest.mark.model_plane
def test_rlengine_timeline_prints_where_each_step_went_and_the_slowest_requests(tmp_path):
    run(tmp_path, timeline=True, steps=2)
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "rlengine.cli", "timeline", str(tmp_path), "--top", "3"],
                          capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "where each step's time went (seconds, share of the step):" in lines
    head = next(line for line in lines if line.split()[:2] == ["step", "wall"])
    assert head.split()[3:] == list(PARTS)  # step, wall, s, then the parts
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ("1", "2")}
    assert set(rows) == {"1", "2"}
    slow = lines.index(next(line for line in lines if line.startswith("slowest requests (3 of ")))
    assert lines[slow + 1].split()[:2] == ["request", "session"] and len(lines[slow + 2:slow + 5]) == 3
    missing = subprocess.run([sys.executable, "-m", "rlengine.cli", "timeline", str(tmp_path / "nothing")],
                             capture_output=True, text=True, timeout=60, env=env, check=False)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_otel_spans_carry_each_kept_event_with_its_own_times():
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    timeline = Timeline(otel=provider.get_tracer("test"))
    timeline.start_steps()
    track = timeline.track("compute")
    origin = timeline.origin
    timeline.job(track, origin + 1.0, origin + 1.5, 3, 1, 1, 0)
    timeline.request(track, settled("s1", origin + 0.5, origin + 0.75, tokens=3, session_id="sess"), "completed",
                     origin + 2.0)
    timeline.step(1, origin, origin + 3.0)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"decode", "request", "step 1"}
    shift = spans["step 1"].start_time - origin * 1e9  # the spans' clock: Unix nanoseconds
    assert spans["request"].start_time - shift == pytest.approx((origin + 0.5) * 1e9, abs=1e3)
    assert spans["request"].end_time - shift == pytest.approx((origin + 2.0) * 1e9, abs=1e3)
    assert spans["request"].attributes["session_id"] == "sess" and spans["request"].attributes["tokens"] == 3
    assert spans["step 1"].attributes["sampling_s"] == pytest.approx(0.5)


@pytest.mark.model_plane
def test_a_capped_run_keeps_its_steps_and_training_calls_and_samples_the_rest(tmp_path):
    document = run(tmp_path, timeline=True, timeline_max_events=250)
    check_format(document)
    events = document["traceEvents"]
    assert len(events) <= 250 and document["otherData"]["stride"] > 1
    steps = [e for e in events if e.get("cat") == "step" and "wall_s" in e.get("args", {})]
    assert [s["args"]["step"] for s in steps] == [1, 2, 3]
    names = [e["name"] for e in events]
    assert names.count("optim_step") == 3 and names.count("seal") == names.count("reopen") >= 3


class Crashed(Exception):
    """Ends a run as a crash would, one step after its checkpoint."""


@pytest.mark.model_plane
def test_a_resumed_run_keeps_each_segments_steps_and_shows_each_step_once(tmp_path, model_cache, capsys):
    """The copy recipe on the torch backend crashes after step 3 (checkpoint at 2) and is resumed to
    step 4: the first segment's file stays as it was, the second gets its own, and the run
    directory reads as steps 1-4, step 3 from the resumed segment, as metrics.jsonl keeps it
    (typically 7 s, 14 s under load)."""
    settings = {"steps": "4", "checkpoint_every": "2", "eval_every": "0", "groups_per_batch": "2",
                "backend": "torch", "cache_dir": model_cache, "timeline": "true"}

    def crash(record: dict[str, Any]) -> None:
        if record["step"] == 3:
            raise Crashed

    first = train("copy", settings, run_dir=str(tmp_path), on_step=crash)
    assert isinstance(first.error, Crashed) and first.checkpoint_step == 2, first.error
    written = (tmp_path / TIMELINE_FILE).read_bytes()
    assert [s["step"] for s in step_rows(json.loads(written))] == [1, 2, 3]
    resumed = train(None, {}, run_dir=str(tmp_path), resume=True)
    assert resumed.error is None and resumed.resumed_from == 2, resumed.error

    assert (tmp_path / TIMELINE_FILE).read_bytes() == written  # the first segment's file, intact
    second = load(segment_path(str(tmp_path), 2))
    check_format(second)  # each file a trace of its own
    assert [s["step"] for s in step_rows(second)] == [3, 4]
    assert (second["otherData"]["segment"], second["otherData"]["resumed_from"]) == (2, 2)
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]  # written through a temporary file

    merged = load(str(tmp_path))
    check_format(merged)
    rows = step_rows(merged)
    metrics = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["segment"]) for r in rows] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for row, line in zip(rows, metrics):
        assert row["wall_s"] == pytest.approx(line["step_time_s"], rel=0.02), (row, line)
    # The second segment runs after the first on the merged trace's clock, as its own process.
    ends = {pid: max(e["ts"] for e in merged["traceEvents"] if e["pid"] == pid and "ts" in e) for pid in (1, 2)}
    assert min(e["ts"] for e in merged["traceEvents"] if e["pid"] == 2 and "ts" in e) > 0 and ends[2] > ends[1]

    from rlengine.cli import main

    assert main(["timeline", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "wall"])
    assert lines[head].split()[-1] == "segment"
    table = [line.split() for line in lines[head + 1:head + 5]]
    assert [(row[0], row[-1]) for row in table] == [("1", "1"), ("2", "1"), ("3", "2"), ("4", "2")]
    assert lines[head + 5].split()[0] == "total"
    assert any("timeline-2.json" in line and "resumed from step 2" in line for line in lines), lines


def _segment(step_numbers: list[int], segment: int, resumed_from: int | None) -> dict[str, Any]:
    """A segment's trace holding steps ``step_numbers``, one second each."""
    timeline = Timeline()
    timeline.start_steps()
    for step in step_numbers:
        timeline.step(step, timeline.origin + step, timeline.origin + step + 1.0)
    return timeline.document({"segment": segment, "resumed_from": resumed_from})


def test_merged_segments_keep_the_steps_metrics_keeps_and_a_fresh_run_drops_stale_segments(tmp_path):
    # 1 ran steps 1-5 (checkpoint at 2); 2 resumed from 2 and crashed after 3 unsaved; 3 resumed from 2
    # again and ran 3-4. metrics.jsonl holds 1-2 of the first and 3-4 of the third: so does the merge.
    documents = [_segment([1, 2, 3, 4, 5], 1, None), _segment([3], 2, 2), _segment([3, 4], 3, 2)]
    merged = merge(documents, [(1, "timeline.json"), (2, "timeline-2.json"), (3, "timeline-3.json")])
    assert [(r["step"], r["segment"]) for r in step_rows(merged)] == [(1, 1), (2, 1), (3, 3), (4, 3)]
    # A resume without a checkpoint starts over: nothing of the earlier segments is shown.
    over = merge([_segment([1, 2], 1, None), _segment([1], 2, -1)], [(1, "timeline.json"), (2, "timeline-2.json")])
    assert [(r["step"], r["segment"]) for r in step_rows(over)] == [(1, 2)]
    # Files without segment notes (an older rlengine): a step several hold is the later one's.
    plain = [_segment([1, 2], 1, None), _segment([2, 3], 2, None)]
    for document in plain:
        del document["otherData"]["resumed_from"]
    assert [r["segment"] for r in step_rows(merge(plain, [(1, "a.json"), (2, "b.json")]))] == [1, 2, 2]

    for name in ("timeline.json", "timeline-2.json", "timeline-3.json", "timeline-x.json"):
        (tmp_path / name).write_text("{}")
    assert new_segment(str(tmp_path), 2) == 4  # a resume: the next file
    assert new_segment(str(tmp_path), None) == 1  # a fresh run: the later segments left here are not its
    assert sorted(os.listdir(tmp_path)) == ["timeline-x.json", "timeline.json"]
