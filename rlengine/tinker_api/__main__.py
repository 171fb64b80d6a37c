"""``python -m rlengine.tinker_api``: an engine and the Tinker API server on its loop, until SIGINT/SIGTERM.

Point the official SDK or the Tinker cookbook at the printed URL::

    python -m rlengine.tinker_api --model tiny --port 8000
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_tinker_script.py

The engine runs in async mode on this process's uvloop, and the server on
that same loop. It prints ``tinker: <url>`` and then ``ready``; on a signal
it stops listening, closes the engine and exits 0 (2 for bad settings).
``rlengine serve`` can serve the same API next to its IPC and OpenAI
servers through ``rlengine.tinker_api.start_async``. This module parses
and runs; it adds no serving logic.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from rlengine.errors import ConfigurationError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlengine.tinker_api",
                                     description="Serve the Tinker REST API for a local rlengine engine.")
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face model directory")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "vllm"],
                        help="model backend of the engine (auto: vLLM if importable, else torch)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (beyond loopback needs --api-key)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    parser.add_argument("--api-key", default=None,
                        help="shared secret every request must carry as X-API-Key (default: any key, loopback only)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where saved training state and named sampler weights go "
                             "(default: <rlengine cache>/tinker-checkpoints)")
    parser.add_argument("--cache-dir", default=None, help="rlengine cache (where model='tiny' is built)")
    parser.add_argument("--max-models", type=int, default=4, help="training models alive at once")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (samples without a seed draw from it)")
    return parser


async def _serve(args: argparse.Namespace) -> int:
    from rlengine.core.config import EngineConfig
    from rlengine.core.engine import Engine
    from rlengine.tinker_api.config import TinkerServerConfig
    from rlengine.tinker_api.server import start_async

    config = TinkerServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                checkpoint_dir=args.checkpoint_dir, max_models=args.max_models)
    engine_config = EngineConfig(model=args.model, backend=args.backend, cache_dir=args.cache_dir, seed=args.seed)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with Engine(engine_config) as engine:
            server = await start_async(engine, config)
            try:
                print(f"tinker: {server.url}", flush=True)
                print(f"ready: model {engine.model_name!r} ({engine.backend.name} backend)", flush=True)
                await stop.wait()
                print("stopping", flush=True)
            finally:
                await server.aclose()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    print("stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlengine.core.engine import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(args))
    except ConfigurationError as exc:
        print(f"python -m rlengine.tinker_api: {exc}", file=sys.stderr)
        return 2
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
