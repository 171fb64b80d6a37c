"""``python -m rlengine.tinker_api``: an engine and the Tinker API server on its loop, until SIGINT/SIGTERM.

Point the official SDK or the Tinker cookbook at the printed URL::

    python -m rlengine.tinker_api --model tiny --port 8000
    export TINKER_API_KEY=$(cat ~/.rlengine/run/tinker-8000.key)    # the key it drew (also printed)
    TINKER_BASE_URL=http://127.0.0.1:8000 python my_tinker_script.py

Without ``--api-key`` the server draws a key, prints it and writes it to
``tinker-<port>.key`` (mode 0600) in ``$XDG_RUNTIME_DIR/rlengine``, else
``~/.rlengine/run``; ``--no-auth`` accepts any key instead (loopback only).
The engine runs in async mode on this process's uvloop, and the server on
that same loop. It prints ``tinker: <url>`` (with a drawn key also
``tinker key: <key>`` and ``tinker key file: <path>``) and then ``ready``; on
a signal it stops listening, removes the key file, closes the engine and
exits 128 + N (130 for SIGINT, 143 for SIGTERM; ``rlengine.signals``: a
second signal exits at once with the same status), 2 for bad settings, 1 when the engine died (then it stops by
itself within a second, whether or not a signal follows).
``rlengine serve`` can serve the same API next to its IPC and OpenAI
servers through ``rlengine.tinker_api.start_async``. This module parses
and runs; it adds no serving logic.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from rlengine.errors import ConfigurationError
from rlengine.signals import StopSignals, until_stopped

__all__ = ["build_parser", "main"]

_PROG = "python -m rlengine.tinker_api"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG,
                                     description="Serve the Tinker REST API for a local rlengine engine.")
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face model directory")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "vllm"],
                        help="model backend of the engine (auto: vLLM if importable, else torch)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (beyond loopback needs --api-key)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    parser.add_argument("--api-key", default=None,
                        help="shared secret every request must carry as X-API-Key, starting 'tml-' (default: a "
                             "random one, printed and written to a 0600 file)")
    parser.add_argument("--no-auth", action="store_true",
                        help="accept any API key (loopback only: every user of this machine can connect)")
    parser.add_argument("--key-file", default=None,
                        help="where a drawn key is written (default: tinker-<port>.key in "
                             "$XDG_RUNTIME_DIR/rlengine, else ~/.rlengine/run)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where saved training state and named sampler weights go "
                             "(default: <rlengine cache>/tinker-checkpoints)")
    parser.add_argument("--cache-dir", default=None, help="rlengine cache (where model='tiny' is built)")
    parser.add_argument("--max-models", type=int, default=4, help="training models alive at once")
    parser.add_argument("--model-alias", action="append", default=[], metavar="NAME=MODEL",
                        help="also answer to base model NAME, standing for the served MODEL (its name or "
                             "directory), e.g. Qwen/Qwen3-8B=tiny; repeatable")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (samples without a seed draw from it)")
    return parser


async def _serve(args: argparse.Namespace, signals: StopSignals) -> int:
    from rlengine.config import EngineConfig
    from rlengine.core.engine import Engine
    from rlengine.core.heap import frozen_heap
    from rlengine.tinker_api.config import TinkerServerConfig
    from rlengine.tinker_api.server import start_async

    aliases = {}
    for word in args.model_alias:
        name, sep, model = word.partition("=")
        if not sep:
            raise ConfigurationError(f"--model-alias {word!r}: must be NAME=MODEL")
        aliases[name] = model
    config = TinkerServerConfig(host=args.host, port=args.port, api_key=args.api_key, no_auth=args.no_auth,
                                key_file=args.key_file, checkpoint_dir=args.checkpoint_dir,
                                max_models=args.max_models, model_aliases=aliases)
    engine_config = EngineConfig(model=args.model, backend=args.backend, cache_dir=args.cache_dir, seed=args.seed)
    stop = asyncio.Event()
    with signals.on_loop(asyncio.get_running_loop(), lambda _signum, _name: stop.set()):
        async with Engine(engine_config) as engine:
            server = await start_async(engine, config)
            try:
                print(f"tinker: {server.url}", flush=True)
                if server.key_file is not None:
                    print(f"tinker key: {server.api_key}\ntinker key file: {server.key_file}", flush=True)
                print(f"ready: model {engine.model_name!r} ({engine.backend.name} backend)", flush=True)
                with frozen_heap():  # start-up's objects out of the collector's full passes
                    died = await until_stopped(stop, [engine], _PROG)
                print("stopping", flush=True)
            finally:
                await server.aclose()
    print("stopped", flush=True)
    return died if died is not None else signals.status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with StopSignals(_PROG) as signals:
        return signals.leave(_run(args, signals))


def _run(args: argparse.Namespace, signals: StopSignals) -> int:
    from rlengine.core.engine import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(args, signals))
    except ConfigurationError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
