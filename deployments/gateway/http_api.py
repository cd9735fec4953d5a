"""The gateway's HTTP surface in raw ASGI: reading a bounded body, strict JSON, the OpenAI error
object, the request id, and the OpenAPI document (for clients and the fuzzing tests). No
framework between uvicorn and the gateway: every request pays only for what it uses.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from cluster.json_types import JSON, JSONObject
from cluster.wire.errors import ClusterError, InvalidRequest, PayloadTooLarge, RequestTimeout
from cluster.wire.native_schemas import MessageCountTokensRequest, MessagesRequest, ResponsesRequest
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest

# ASGI's scope and messages (the ASGI spec): each key has its own type (str, int, bytes, header
# pairs, nested dicts), which the spec's plain dicts cannot say, so their values stay Any.
Scope = JSONObject
Message = JSONObject
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]  # an ASGI 3 application, or a route of ours
M = TypeVar("M", bound=BaseModel)

SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# OpenAI bodies nest a few levels (tools' JSON schemas a few more); deeper JSON is refused with a
# 400 before pydantic or the JSON parser itself hit their recursion limits (a 500).
MAX_JSON_DEPTH = 64
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class UnsupportedMediaType(ClusterError):
    status_code = 415
    error_type = "invalid_request_error"
    code = "unsupported_media_type"


def header(scope: Scope, name: bytes) -> str | None:
    k: bytes
    v: bytes
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def no_route(method: str, path: str, routes: Iterable[tuple[str, str]]) -> ClusterError:
    """The answer to a path we do not serve (404 ``not_found``), or to a path we serve with another
    method (405). An internal path counts as unknown whatever the method, and so does
    ``/internal/status`` asked without the internal credential: nothing tells a caller it exists."""
    known = not path.startswith("/internal/") and any(p == path for _, p in routes)
    return ClusterError(
        f"{method} {path}: {'Method Not Allowed' if known else 'Not Found'}",
        status_code=405 if known else 404,
        code="method_not_allowed" if known else "not_found",
        error_type="invalid_request_error",
    )


def new_request_id() -> str:
    """Our own id for a request, unique. The client's ``x-request-id`` is never used inside (not as
    the engine's request id, not as a budget key): two clients may send the same one."""
    return uuid.uuid4().hex


def check_json_content_type(scope: Scope) -> None:
    """JSON bodies only: ``application/json`` (with parameters) or no content type at all."""
    ctype = header(scope, b"content-type")
    if ctype is None:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type '{ctype[:100]}' is not supported: send the body as application/json."
        )


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, at most ``limit`` bytes (else a 413), in full within ``timeout_s`` (else a
    408: a client that trickles its body or stops sending it holds the connection no longer)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
    if timeout_s is None:
        return await _read_body(receive, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive in full within {timeout_s:g} s.") from None


async def _read_body(receive: Receive, limit: int) -> bytes:
    buf = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("the client went away while sending the body")
        buf += msg.get("body", b"")
        if len(buf) > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
        if not msg.get("more_body", False):
            return bytes(buf)


# A run of 19 digits may be an integer past 64 bits, which orjson reads as a float.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def parse_json(buf: bytes) -> JSON:
    """Strict UTF-8 JSON (RFC 8259), at most ``MAX_JSON_DEPTH`` deep, with no lone surrogates
    (``"\\ud800"`` is valid JSON but not Unicode: tokenizers and UTF-8 encoders fail on it later).

    The common body takes orjson's path: orjson checks UTF-8 and refuses lone surrogates itself, so
    only the depth is left to check. Anything orjson refuses or reads differently from ``json``
    (NaN, an integer past 64 bits) takes the general path: the same answer, the precise error."""
    if not _LONG_DIGITS.search(buf):
        try:
            body = orjson.loads(buf)
        except orjson.JSONDecodeError:
            pass
        else:
            _check_depth(body)
            return body
    try:
        body = json.loads(buf.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.") from exc
    _check_depth(body, strings=True)
    return body


def _check_depth(body: JSON, strings: bool = False) -> None:
    """A 400 past ``MAX_JSON_DEPTH`` levels; with ``strings``, also for a lone surrogate in any
    string (keys included)."""
    kinds = (str, dict, list) if strings else (dict, list)
    stack = [(body, 1)]  # iterative: no recursion of our own
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if strings and not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise InvalidRequest("The request body holds a lone UTF-16 surrogate escape.") from exc
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
        if isinstance(node, dict):
            if strings:
                stack.extend((k, depth) for k in node)
            node = node.values()
        elif not isinstance(node, list):
            continue
        stack.extend((c, depth + 1) for c in node if isinstance(c, kinds))


def validate(schema: type[M], body: JSON) -> M:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        if first["type"] == "extra_forbidden":  # OpenAI's own words for a field it does not know
            msg = f"Unrecognized request argument supplied: {loc}"
            raise InvalidRequest(msg, param=loc, code="unrecognized_argument") from exc
        raise InvalidRequest(f"Invalid value for '{loc}': {first['msg']}", param=loc or None) from exc


def _headers(extra: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]


async def send_json(send: Send, status: int, obj: JSON, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + _headers(headers or {})})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: ClusterError) -> None:
    """The OpenAI error object. No ``x-request-id`` of ours: Serve's middleware adds exactly one to
    every response (the client's, or one it made), and ours would be a second, different one."""
    await send_json(send, err.status_code, err.to_openai(), err.headers())


async def start_sse(send: Send, headers: dict[str, str]) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + _headers(headers)})


# -- OpenAPI ---------------------------------------------------------------------------------------
_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_HEADERS = [
    {"name": "x-surface", "in": "header", "required": False, "schema": {"type": "string"}},
    {"name": "x-session-id", "in": "header", "required": False, "schema": {"type": "string"}},
]
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _errors(schema: str, what: str) -> JSONObject:
    ref = {"$ref": _REF.format(model=schema)}
    return {"default": {"description": what, "content": {"application/json": {"schema": ref}}}}


_ERRORS = _errors("ErrorResponse", "An OpenAI error object.")


def _post(model: type[BaseModel], summary: str, errors: JSONObject = _ERRORS) -> JSONObject:
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "parameters": _HEADERS,
            "responses": {"200": {"description": "The answer (SSE when stream is true)."}, **errors},
        }
    }


def openapi_document(title: str = "llm-cluster", version: str = "0.1.0") -> JSONObject:
    schemas: JSONObject = {"ErrorResponse": _ERROR_SCHEMA, "AnthropicError": _ANTHROPIC_ERROR_SCHEMA}
    requests = (ChatCompletionRequest, CompletionRequest, MessagesRequest, MessageCountTokensRequest)
    for model in (*requests, ResponsesRequest):
        schema = model.model_json_schema(ref_template=_REF)
        for name, sub in schema.pop("$defs", {}).items():
            if schemas.setdefault(name, sub) != sub:
                raise ValueError(f"two request schemas define {name!r} differently")
        schemas[model.__name__] = schema
    ok = {"200": {"description": "OK"}, **_ERRORS}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/chat/completions": _post(ChatCompletionRequest, "OpenAI chat completions"),
            "/v1/completions": _post(CompletionRequest, "OpenAI completions"),
            "/v1/messages": _post(
                MessagesRequest,
                "Anthropic Messages (served through the chat route)",
                _errors("AnthropicError", "An Anthropic error object."),
            ),
            "/v1/messages/count_tokens": _post(
                MessageCountTokensRequest,
                "Anthropic token counting: the prompt's tokens as /v1/messages would count them",
                _errors("AnthropicError", "An Anthropic error object."),
            ),
            "/v1/responses": _post(ResponsesRequest, "OpenAI Responses (minimal, stateless)"),
            "/v1/models": {"get": {"summary": "The configured models", "responses": ok}},
            "/healthz": {"get": {"summary": "Liveness", "responses": ok}},
        },
        "components": {"schemas": schemas},
    }
