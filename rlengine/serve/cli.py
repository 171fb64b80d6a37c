"""``rlengine serve [key=value ...]``: engines plus the IPC and HTTP servers, until a signal.

Settings are ``key=value`` words: any ``EngineConfig`` field (``model``,
``backend``, ``drain_policy``, ``sim.gen_len``, ``model_args.max_position_embeddings``,
``engine_args.<name>``, ...), any ``ServeConfig``
field (``socket_path``, ``port``, ``api_key``, ``http=false``, ...) and
``replicas=N`` (data-parallel engines on the one loop; replica i gets
``seed + i``). Values are parsed as JSON when they parse (``4``, ``true``,
``null``), else taken as strings, then converted to the field's type.

With ``--tinker`` it also serves the Tinker REST API on replica 0
(``tinker.<field>=value`` sets ``TinkerServerConfig`` fields).

HTTP and the Tinker API need an API key: ``api_key`` / ``tinker.api_key``,
or by default a random one, printed and written to a 0600 file
(``http-<port>.key``, ``tinker-<port>.key`` in ``$XDG_RUNTIME_DIR/rlengine``,
else ``~/.rlengine/run``; ``key_file`` to choose); ``no_auth=true`` /
``tinker.no_auth=true`` accept any request instead (loopback only).

It prints the servers' addresses (``ipc: <path>``, ``http: <url>``,
``tinker: <url>``; with a drawn key ``http key: <key>`` and
``http key file: <path>``, likewise ``tinker key``), then ``ready``, and runs
until SIGINT or SIGTERM (``rlengine.signals``: a second one exits at once);
then turns in flight settle (finished within ``grace_s`` or aborted), the
socket file is removed and the engines close. Exit status 128 + N after a
stop by signal N (130 for SIGINT, 143 for SIGTERM), 2 for bad settings (one
line naming the setting and what it accepts; a port in use is one too), 1
when an engine died (its backend failed), whether or not a signal came
after: the servers then stop on their own within a second, and
``GET /health`` answers 503 until they do.

A hang watch runs beside the servers (``rlengine.core.hangs``): with
requests pending and no token, settlement or training call for
``--hang-timeout-s`` (default: max(120 s, 10x the longest such quiet spell
seen)), it writes a dump (every thread's stack, the requests in flight, the
install gate, the compute thread's call) to ``--dump-dir`` (default: the
state directory, where drawn keys go) and prints one line naming it;
SIGUSR1 writes one on demand. The server keeps running either way.

``--timeline`` records every request, backend job, training call and gate
phase (``rlengine.timeline``); ``GET /v1/admin/timeline`` (with the API key)
returns it as Chrome trace-event JSON, which Perfetto's UI opens.

vLLM's, transformers' and torch's own logs stay quiet unless ``-v``
(``rlengine.console``).

``rlengine.cli`` wires ``add_parser`` and ``run`` in as its ``serve``
command; ``python -m rlengine.serve.cli`` runs it alone. This module parses
and runs; it adds no serving logic.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import sys
from typing import Any

import msgspec

from rlengine.console import plain, quiet_third_party
from rlengine.errors import ConfigurationError
from rlengine.signals import StartUpInterrupted, StopSignals, until_stopped
from rlengine.validation import convert_error

__all__ = ["add_parser", "main", "parse_settings", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` command to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve", help="serve agent sandboxes over IPC and OpenAI-compatible HTTP until SIGINT/SIGTERM",
        description=plain(__doc__.split("\n\n")[1]))
    parser.add_argument("settings", nargs="*", metavar="key=value",
                        help="EngineConfig / ServeConfig fields, replicas=N and tinker.* (TinkerServerConfig "
                             "fields, with --tinker), e.g. backend=sim port=8000 tinker.port=8001")
    parser.add_argument("--tinker", action="store_true",
                        help="also serve the Tinker REST API (for the tinker SDK and cookbook) on replica 0")
    parser.add_argument("--demo", action="store_true",
                        help="try it with an agent: the tiny model's tokenizer and replies that read the request "
                             "(calls the first tool offered, then answers with its result); settings still apply")
    parser.add_argument("--dump-dir", metavar="DIR", default=None,
                        help="where hang dumps go (SIGUSR1, or no progress for --hang-timeout-s); default: the "
                             "state directory ($XDG_RUNTIME_DIR/rlengine, else ~/.rlengine/run)")
    parser.add_argument("--hang-timeout-s", metavar="S", type=float, default=None,
                        help="dump when requests are pending and nothing progressed for S seconds; default: "
                             "max(120, 10x the longest quiet spell seen); 0: only on SIGUSR1")
    parser.add_argument("--timeline", action="store_true",
                        help="record a timeline of requests, backend jobs, training calls and gate phases, served "
                             "as trace-event JSON at GET /v1/admin/timeline (with the API key)")
    parser.add_argument("--timeline-max-events", metavar="N", type=int, default=None,
                        help="the most events the timeline holds; beyond it requests and backend jobs are sampled "
                             "evenly (default 500000)")
    parser.add_argument("--timeline-otel", action="store_true",
                        help="with --timeline, also send each event as an OpenTelemetry span (needs "
                             "opentelemetry-api, and a tracer provider set up in this process)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show vLLM's, transformers' and torch's own logs and loading bars (on stderr)")
    return parser


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_settings(words: list[str]) -> tuple[Any, Any, int]:
    """``(EngineConfig, ServeConfig, replicas)`` from ``key=value`` words (``tinker.*`` ignored here)."""
    from rlengine.config import EngineConfig
    from rlengine.serve.server import ServeConfig

    engine_fields = set(EngineConfig.__struct_fields__)
    serve_fields = set(ServeConfig.__struct_fields__)
    engine: dict[str, Any] = {}
    serve: dict[str, Any] = {}
    replicas = 1
    for word in words:
        key, sep, raw = word.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"setting {word!r}: must be key=value")
        value = _value(raw)
        top, _, sub = key.partition(".")
        if top == "tinker":
            continue  # see tinker_settings
        if key == "replicas":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"replicas={raw!r}: must be an integer >= 1")
            replicas = value
        elif top in engine_fields and sub:
            nested = {f.name: f.type for f in msgspec.structs.fields(EngineConfig)}[top]
            known = getattr(nested, "__struct_fields__", None)
            if known is None and getattr(nested, "__origin__", None) is not dict:
                raise ConfigurationError(f"setting {key!r}: {top} takes no sub-settings")
            if known is not None and sub not in known:
                raise ConfigurationError(f"setting {key!r}: unknown; {top}.* takes {', '.join(sorted(known))}")
            engine.setdefault(top, {})[sub] = value  # a dict field (model_args, engine_args) takes any key
        elif key in engine_fields:
            engine[key] = value
        elif key in serve_fields:
            serve[key] = value
        else:
            raise ConfigurationError(f"setting {key!r}: unknown; known: replicas, "
                                     f"{', '.join(sorted(engine_fields | serve_fields))}")
    out = []
    for cls, given in ((EngineConfig, engine), (ServeConfig, serve)):
        try:
            out.append(msgspec.convert(given, cls, strict=False))
        except msgspec.ValidationError as exc:
            raise ConfigurationError(f"bad setting: {convert_error(cls, exc, given)}") from None
    return out[0], out[1], replicas


def tinker_settings(words: list[str]) -> Any:
    """The ``TinkerServerConfig`` from the ``tinker.<field>=value`` words."""
    from rlengine.tinker_api.config import TinkerServerConfig

    given: dict[str, Any] = {}
    for word in words:
        key, _, raw = word.partition("=")
        top, _, sub = key.partition(".")
        if top != "tinker":
            continue
        if sub not in TinkerServerConfig.__struct_fields__:
            raise ConfigurationError(f"setting {key!r}: unknown; tinker.* takes "
                                     f"{', '.join(sorted(TinkerServerConfig.__struct_fields__))}")
        given[sub] = _value(raw)
    try:
        return msgspec.convert(given, TinkerServerConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigurationError(f"bad tinker setting: tinker.{convert_error(TinkerServerConfig, exc, given)}") from None


def _cannot_listen(exc: OSError, setting: str, host: str, port: int) -> BaseException:
    """A port that is taken (or needs privileges) as the setting's error, one line, not a traceback;
    any other failure to listen (the IPC socket's path, say) as it was."""
    if port == 0 or f"{port})" not in str(exc):  # asyncio names the address it could not bind: (host, port)
        return exc
    if exc.errno == errno.EADDRINUSE:
        why = "in use (another process listens there)"
    elif exc.errno in (errno.EACCES, errno.EADDRNOTAVAIL):
        why = f"not available here ({exc.strerror})"
    else:
        return exc
    return ConfigurationError(f"{setting}={port}: cannot listen on {host}:{port}, {why}; choose another "
                              f"{setting}=N, or {setting}=0 for any free port")


async def _start(engines: list[Any], engine_cfg: Any, serve_cfg: Any, replicas: int,
                 tinker_cfg: Any, timeline: Any = None) -> tuple[Any, Any]:
    """Start the engines (into ``engines`` as they come, for the caller to close), the servers and
    the Tinker API; print their addresses and ``ready``. Returns ``(server, tinker server or None)``."""
    from rlengine.core.engine import Engine
    from rlengine.serve.server import Server

    for i in range(replicas):
        engine = Engine(msgspec.structs.replace(engine_cfg, seed=engine_cfg.seed + i), timeline=timeline)
        engines.append(engine)
        await engine.start_async()
    try:
        server = await Server(engines, serve_cfg).start_async()
    except OSError as exc:
        raise _cannot_listen(exc, "port", serve_cfg.host, serve_cfg.port) from None
    tinker = None
    try:
        if server.ipc_path:
            print(f"ipc: {server.ipc_path}", flush=True)
        if server.http_url:
            print(f"http: {server.http_url}", flush=True)
        if server.key_file is not None:
            print(f"http key: {server.api_key}\nhttp key file: {server.key_file}", flush=True)
        if tinker_cfg is not None:
            from rlengine.tinker_api.server import start_async as start_tinker

            try:
                tinker = await start_tinker(engines[0], tinker_cfg)
            except OSError as exc:
                raise _cannot_listen(exc, "tinker.port", tinker_cfg.host, tinker_cfg.port) from None
            print(f"tinker: {tinker.url}", flush=True)
            if tinker.key_file is not None:
                print(f"tinker key: {tinker.api_key}\ntinker key file: {tinker.key_file}", flush=True)
    except BaseException:
        await server.aclose()
        raise
    print(f"ready: model {server.model_name!r}, {replicas} replica(s)", flush=True)
    return server, tinker


async def _serve(engine_cfg: Any, serve_cfg: Any, replicas: int, tinker_cfg: Any, signals: StopSignals,
                 hangs: Any, timeline: Any = None) -> int:
    from rlengine.core.hangs import task_stacks
    from rlengine.core.heap import frozen_heap

    stop = asyncio.Event()
    engines: list[Any] = []
    server: Any = None
    tinker: Any = None
    died: int | None = None
    loop = asyncio.get_running_loop()
    hangs.add_source("tasks", lambda: task_stacks(loop))
    # The watch runs from start-up on (a SIGUSR1 then shows the threads' stacks) until the engines closed.
    with signals.on_loop(loop, lambda _signum, _name: stop.set()), signals.dumps(hangs.request_dump), hangs:
        try:
            try:
                async with signals.start_up():  # a signal cancels it; what started closes below
                    server, tinker = await _start(engines, engine_cfg, serve_cfg, replicas, tinker_cfg, timeline)
            except StartUpInterrupted:
                pass
            else:
                for i, engine in enumerate(engines):
                    hangs.watch("engine" if replicas == 1 else f"engine_{i}", engine)
                # A dead engine ends the process (its supervisor sees a non-zero exit), after
                # everything pending has settled: the engine failed its requests as it died.
                # Start-up's objects out of the collector's full passes (rlengine.core.heap).
                with frozen_heap():
                    died = await until_stopped(stop, engines, "rlengine serve")
            print("stopping", flush=True)
        finally:
            if tinker is not None:
                await tinker.aclose()
            if server is not None:
                await server.aclose()
            for engine in engines:
                await engine.aclose()
    print("stopped", flush=True)
    return died if died is not None else signals.status


def run(args: argparse.Namespace) -> int:
    """Run ``rlengine serve`` with parsed ``args``; returns the exit status."""
    # Before anything imports vLLM, transformers or torch: they read these as they load.
    quiet_third_party(getattr(args, "verbose", False))
    with StopSignals("rlengine serve") as signals:
        return signals.leave(_run(args, signals))


def _run(args: argparse.Namespace, signals: StopSignals) -> int:
    try:
        demo = ["backend=scripted", "model=tiny", "engine_args.script=demo"] if getattr(args, "demo", False) else []
        engine_cfg, serve_cfg, replicas = parse_settings(demo + args.settings)
        tinker_cfg = tinker_settings(args.settings) if getattr(args, "tinker", False) else None
        if tinker_cfg is None and any(w.startswith("tinker.") for w in args.settings):
            raise ConfigurationError("tinker.* settings need --tinker")
        hangs = _hang_watch(args)
        timeline = _timeline(args)
        if timeline is not None:
            hangs.add_source("timeline", timeline.recent)
    except ConfigurationError as exc:
        print(f"rlengine serve: {exc}", file=sys.stderr)
        return 2
    from rlengine.core.engine import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(engine_cfg, serve_cfg, replicas, tinker_cfg, signals, hangs, timeline))
    except ConfigurationError as exc:
        print(f"rlengine serve: {exc}", file=sys.stderr)
        return 2
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _hang_watch(args: argparse.Namespace) -> Any:
    """The command's ``HangWatch``: ``--dump-dir`` (else the state directory) and ``--hang-timeout-s``."""
    from rlengine.core.api_keys import runtime_dir
    from rlengine.core.hangs import HangWatch

    directory = getattr(args, "dump_dir", None)
    # The state directory is checked when a dump is written: a bad one costs the dump, not the server.
    return HangWatch(directory if directory is not None else runtime_dir, prog="rlengine serve",
                     timeout_s=getattr(args, "hang_timeout_s", None), setting="--hang-timeout-s")


def _timeline(args: argparse.Namespace) -> Any:
    """The engines' ``Timeline`` with ``--timeline`` (None without); the options without it are refused."""
    from rlengine.timeline import DEFAULT_MAX_EVENTS, Timeline

    cap, otel = getattr(args, "timeline_max_events", None), getattr(args, "timeline_otel", False)
    if not getattr(args, "timeline", False):
        if cap is not None or otel:
            raise ConfigurationError("--timeline-max-events and --timeline-otel need --timeline")
        return None
    return Timeline(DEFAULT_MAX_EVENTS if cap is None else cap, otel=otel or None, setting="--timeline-max-events")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlengine")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
