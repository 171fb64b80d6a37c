"""rlengine.serve: agent sandboxes talk to the engine over msgspec IPC or OpenAI-compatible HTTP.

One role per module:

* ``server``   - ``Server`` and ``ServeConfig``: wires the parts together on the engines' loop;
* ``ipc``      - the unix-socket server (frames of ``rlengine.protocol`` messages);
* ``http``     - the OpenAI-compatible HTTP server (aiohttp, on the same loop);
* ``sessions`` - sessions, tokens, exact trace capture, turns through the gate;
* ``router``   - session affinity over replicas, tombstones of retired sessions;
* ``errors``   - exceptions -> wire codes and HTTP statuses;
* ``cli``      - ``rlengine serve [key=value ...]``.

Names load on first use, so importing this package pulls in neither the
engine nor aiohttp. Sandboxes import ``rlengine.sandbox_client``, never this package.
"""

from typing import Any

__all__ = ["ServeConfig", "Server", "SessionManager", "SessionRouter", "SessionTrace"]

_FROM = {"ServeConfig": "server", "Server": "server", "SessionManager": "sessions", "SessionTrace": "sessions",
         "SessionRouter": "router"}


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'rlengine.serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"rlengine.serve.{module}"), name)
