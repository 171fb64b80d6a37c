"""rlengine.serve: agent sandboxes talk to the engine over msgspec IPC or OpenAI-compatible HTTP.

One role per module:

* ``server``           - ``Server`` and ``ServeConfig``: wires the parts together on the engines' loop;
* ``ipc``              - the unix-socket server (frames of ``rlengine.protocol`` messages);
* ``http``             - the HTTP application (aiohttp, on the same loop): routes, API key, sessions
  from requests, the endpoints of sessions, models and operators;
* ``http_turns``       - the chat-turn endpoints of every API;
* ``http_stream``      - streamed turns as server-sent events;
* ``http_wire``        - request bodies and error responses;
* ``chat_completions``, ``anthropic``, ``responses`` - each API translated to chat turns (no I/O);
* ``sessions``         - ``SessionManager``: turns routed to a replica and submitted to its scheduler;
* ``retention``        - which sessions exist and for how long (``Retention``);
* ``capture``          - exact trace capture, rewards, the export;
* ``leases``           - turns in flight, abandoned or aborted;
* ``session_types``    - the session layer's records (``Session``, ``TurnResult``, ``SessionTrace``);
* ``router``           - session affinity over replicas, tombstones of retired sessions;
* ``errors``           - exceptions -> wire codes and HTTP statuses;
* ``cli``              - ``rlengine serve [key=value ...]``.

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
