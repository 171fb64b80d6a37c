"""What every HTTP endpoint shares of the wire: request bodies in, JSON and error responses out.

Bodies are decoded by typed msgspec JSON decoders; anything one rejects is a
400 (``bad_message``) naming the field. Errors have OpenAI's shape
(``{"error": {"message", "type", "code", "param", "value"}}``, ``param``
naming the field at fault and ``value`` its value), or Anthropic's on its
Messages API, with the status of their code
(``rlengine.serve.errors.HTTP_STATUS``): this module spells the responses,
``serve.errors`` decides the codes and statuses. No handler logic here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from rlengine.protocol import BadMessage
from rlengine.serve.errors import HTTP_STATUS, to_serve_error

__all__ = ["RewardBody", "SessionBody", "error_response", "http_error_response", "json_response", "read_body",
           "unauthorized_response"]


class SessionBody(msgspec.Struct, frozen=True):
    """The body of ``POST /v1/sessions`` (optional): ``roles`` declares the agent roles its turns
    name in the ``X-RLEngine-Role`` header, each mapped to whether it trains."""

    session_id: str | None = None
    roles: dict[str, bool] | None = None


class RewardBody(msgspec.Struct, frozen=True):
    """The body of ``POST /v1/sessions/{id}/reward``."""

    value: float


async def read_body(request: web.Request, decoder: msgspec.json.Decoder) -> Any:
    """The request's body, decoded by ``decoder``; what it rejects is a ``BadMessage`` naming the field."""
    body = await request.read()
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMessage(f"bad request body: {exc}") from None


def json_response(encode: Callable[[Any], bytes], body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode(body), status=status, content_type="application/json")


def error_response(exc: BaseException, anthropic: bool = False) -> web.Response:
    """The error response for ``exc``: OpenAI's shape, or Anthropic's on its Messages API."""
    err = to_serve_error(exc)
    status = HTTP_STATUS.get(err.code, 500)
    if anthropic:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            status, "invalid_request_error" if status < 500 else "api_error")
        return web.json_response({"type": "error", "error": {"type": kind, "message": f"{err.code}: {err}",
                                                              "param": err.field, "value": err.value}},
                                 status=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    # OpenAI's ``param`` names the field at fault; ``value`` (its repr) is ours.
    body = {"error": {"message": str(err), "type": kind, "code": err.code, "param": err.field, "value": err.value}}
    return web.json_response(body, status=status)


def unauthorized_response(key_file: str | None = None) -> web.Response:
    """401: a request without the server's API key. The message says where the key is: the file a
    drawn key was written to (``key_file``), else the server's ``api_key`` setting; a script that
    worked before servers drew keys gets its answer from the error alone."""
    if key_file is not None:
        where = (f"this server drew its key at start-up (printed as 'http key: ...'); it is in {key_file} "
                 f"(e.g. export OPENAI_API_KEY=$(cat {key_file}))")
    else:
        where = "the key is the server's api_key setting (rlengine serve api_key=...)"
    body = {"error": {"message": f"missing or wrong API key: send Authorization: Bearer <key> (the openai "
                                 f"client's api_key) or x-api-key: <key>; {where}",
                      "type": "invalid_request_error", "code": "unauthorized", "param": None}}
    return web.json_response(body, status=401)


def http_error_response(exc: web.HTTPException) -> web.Response | None:
    """aiohttp's own refusals (an unknown route, a body over ``client_max_size``) in OpenAI's
    shape; None for a status below 400 (a redirect, re-raised as it is)."""
    if exc.status == 413:
        body = {"error": {"message": f"request body too large: {exc.text}", "type": "invalid_request_error",
                          "code": "frame_too_large", "param": None}}
        return web.json_response(body, status=413)
    if exc.status >= 400:
        body = {"error": {"message": exc.reason, "type": "invalid_request_error",
                          "code": "not_found" if exc.status == 404 else "bad_message", "param": None}}
        return web.json_response(body, status=exc.status)
    return None
