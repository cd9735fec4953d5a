"""The HTTP ingress: OpenAI-compatible routes in FastAPI, inside Ray Serve.

auth → surface, size limit (413 before the body is read whole), parse + validate (400 naming the
field), SSE out chunk by chunk as the router yields them, and a client disconnect cancels the
router's stream (which cancels the backend's). Every response carries ``x-request-id``; every
error is an OpenAI error object.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import ClusterConfig
from cluster.errors import (
    ClusterError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    StreamInterrupted,
    Unauthorized,
    UpstreamTimeout,
)
from cluster.openai_format import SSE_DONE, ResponseMeta, full_response, sse, stream_chunk, usage_chunk
from cluster.protocol import ChatCompletionRequest, Chunk, CompletionRequest, Usage
from deployments.router import unwrap

app = FastAPI(title="llm-cluster", version="0.1.0")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# OpenAI bodies nest a few levels (tools' JSON schemas a few more); deeper JSON is refused with a
# 400 before pydantic, pickling or the JSON parser itself hit their recursion limits (a 500).
MAX_JSON_DEPTH = 64
BIG_BODY = 256 * 1024

# -- OpenAPI: the routes read the raw Request (for the 413 before the body is read whole), so their
# request bodies and headers are declared here, for clients and fuzzers (tests/reliability).
_SCHEMA_REF = "#/components/schemas/{model}"
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
_ERRORS = {
    "default": {
        "description": "An OpenAI error object.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
}


def _body_spec(model: type) -> dict[str, Any]:
    ref = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        "parameters": _HEADERS,
        "responses": _ERRORS,
    }


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request schemas; pydantic's ``$defs`` moved into components so
    every ``$ref`` resolves within the document."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatCompletionRequest, CompletionRequest):
            schema = model.model_json_schema(ref_template=_SCHEMA_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        schemas["ErrorResponse"] = _ERROR_SCHEMA
        app.openapi_schema = doc
    return app.openapi_schema


app.openapi = _openapi  # type: ignore[method-assign]


def error_response(err: ClusterError, request_id: str) -> JSONResponse:
    return JSONResponse(
        err.to_openai(), status_code=err.status_code, headers={**err.headers(), "x-request-id": request_id}
    )


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    rid = _request_id(request)
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    err = ClusterError(
        f"{request.method} {request.url.path}: {exc.detail}",
        status_code=exc.status_code,
        code=kind,
        error_type="invalid_request_error",
    )
    return error_response(err, rid)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ClusterError(f"internal error: {type(exc).__name__}"), _request_id(request))


def _request_id(request: Request) -> str:
    """Serve's own request id: it honours a client's x-request-id and echoes it in the response."""
    rid = serve.context._get_serve_request_context().request_id
    if rid and _SAFE_ID.match(rid):
        return rid
    return uuid.uuid4().hex


def _parse_json(buf: bytes) -> Any:
    """Strict UTF-8 JSON (RFC 8259), at most ``MAX_JSON_DEPTH`` deep, with no lone surrogates
    (``"\\ud800"`` is valid JSON but not Unicode: tokenizers and UTF-8 encoders fail on it later)."""
    try:
        body = json.loads(buf.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.") from exc
    stack = [(body, 1)]  # iterative: no recursion of our own
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise InvalidRequest("The request body holds a lone UTF-16 surrogate escape.") from exc
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.")
        if isinstance(node, dict):
            stack.extend((k, depth) for k in node)
            node = node.values()
        elif not isinstance(node, list):
            continue
        stack.extend((c, depth + 1) for c in node if isinstance(c, (str, dict, list)))
    return body


def _internal_error(exc: BaseException) -> ClusterError:
    """A failure that is not a typed error. A router replica that died (restarted by Serve) is a
    503 worth retrying, not a 500; anything else is ours, and says only its type."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        return Overloaded("A router replica restarted while serving this request; retry it.", retry_after_s=1)
    return ClusterError(f"internal error: {type(exc).__name__}")


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"Invalid value for '{loc}': {first['msg']}", loc or None


async def _sse_stream(
    gen: Any, first: Chunk | None, meta: ResponseMeta, include_usage: bool
) -> AsyncIterator[bytes]:
    usage: Usage | None = None
    sent_first = False
    try:
        chunk = first
        while chunk is not None:
            if chunk.text or chunk.finish_reason is not None or not sent_first:
                yield sse(stream_chunk(meta, chunk.text, chunk.finish_reason, first=not sent_first))
                sent_first = True
            if chunk.usage is not None:
                usage = chunk.usage
            try:
                chunk = await gen.__anext__()
            except StopAsyncIteration:
                chunk = None
        if include_usage and usage is not None:
            yield sse(usage_chunk(meta, usage))
    except Exception as raw:
        exc = unwrap(raw)
        err = (
            exc
            if isinstance(exc, ClusterError)
            else StreamInterrupted(f"stream failed: {type(exc).__name__}")
        )
        yield sse(err.to_openai())
    finally:
        gen.cancel()  # a client disconnect lands here: stop the router and the backend
    yield SSE_DONE


async def _collect(gen: Any, first: Chunk | None, meta: ResponseMeta) -> dict[str, Any]:
    parts: list[str] = []
    finish = "stop"
    usage = Usage()
    chunk = first
    try:
        while chunk is not None:
            parts.append(chunk.text)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
            try:
                chunk = await gen.__anext__()
            except StopAsyncIteration:
                chunk = None
    except Exception as raw:
        exc = unwrap(raw)
        raise (
            exc
            if isinstance(exc, ClusterError)
            else StreamInterrupted(f"generation failed: {type(exc).__name__}")
        ) from raw
    finally:
        gen.cancel()
    return full_response(meta, "".join(parts), finish, usage)


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(app)
class Ingress:
    def __init__(self, config: dict[str, Any], router: DeploymentHandle) -> None:
        self.cfg = ClusterConfig.model_validate(config)
        self.router = router.options(stream=True)
        self._keys = {k.sha256: k.surface for k in self.cfg.server.api_keys}

    # -- helpers --------------------------------------------------------------------------------
    def _deadline(self, surface: str) -> float:
        s = self.cfg.surface(surface)
        return s.request_timeout_s if s is not None else 600.0

    def _surface(self, request: Request) -> str:
        if self.cfg.server.auth:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            surface = self._keys.get(hashlib.sha256(key.encode()).hexdigest()) if key else None
            if surface is None:
                raise Unauthorized("Missing or invalid API key. Pass it as 'Authorization: Bearer <key>'.")
            return surface
        surface = request.headers.get("x-surface") or self.cfg.server.default_surface
        if self.cfg.surface(surface) is None:
            known = ", ".join(s.name for s in self.cfg.surfaces)
            raise InvalidRequest(
                f"Unknown surface '{surface}' in x-surface (known: {known}).", param="x-surface"
            )
        return surface

    async def _read_body(self, request: Request) -> Any:
        limit = self.cfg.server.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
        # A big body is parsed and checked off the event loop (it serves every other request).
        return await asyncio.to_thread(_parse_json, bytes(buf)) if len(buf) > BIG_BODY else _parse_json(buf)

    async def _handle(self, request: Request, kind: str) -> Response:
        rid = _request_id(request)
        try:
            surface = self._surface(request)
            body = await self._read_body(request)
            if not isinstance(body, dict):
                raise InvalidRequest("The request body must be a JSON object.")
            schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
            try:
                api = schema.model_validate(body)
            except ValidationError as exc:
                msg, param = _validation_message(exc)
                raise InvalidRequest(msg, param=param) from exc
            if self.cfg.model(api.model) is None:
                raise NotFound(
                    f"The model '{api.model}' does not exist or you do not have access to it.", param="model"
                )
            session = request.headers.get("x-session-id") or api.user
            if session is not None and not _SAFE_ID.match(session):
                raise InvalidRequest(
                    "x-session-id / user must be 1-128 characters of [A-Za-z0-9._:-].", param="user"
                )
            ctx = {"kind": kind, "request_id": rid, "surface": surface, "session_id": session}
            gen = self.router.generate.remote(api.model_dump(mode="json", exclude_unset=True), ctx)
            meta = ResponseMeta(kind=kind, request_id=rid, model=api.model)  # type: ignore[arg-type]
            try:
                # Bounded by the surface's deadline: a router restarting must not hold the client.
                first = await asyncio.wait_for(gen.__anext__(), self._deadline(surface))
            except StopAsyncIteration:
                first = None
            except TimeoutError as exc:
                gen.cancel()
                raise UpstreamTimeout("No answer before the request's deadline.") from exc
            except Exception as raw:
                exc = unwrap(raw)
                raise (exc if isinstance(exc, ClusterError) else _internal_error(exc)) from raw
            if first is not None and first.model:
                meta.model = first.model  # a bigger-window model took it
        except ClusterError as err:
            return error_response(err, rid)
        # Who served it: for operators and tests (the replica that produced the first chunk).
        headers = (
            {"x-llmc-backend": first.backend or "", "x-llmc-replica": first.replica or ""} if first else {}
        )
        if api.stream:
            include_usage = bool(api.stream_options and api.stream_options.include_usage)
            return StreamingResponse(
                _sse_stream(gen, first, meta, include_usage),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        try:
            return JSONResponse(await _collect(gen, first, meta), headers=headers)
        except ClusterError as err:
            return error_response(err, rid)

    # -- routes ---------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=_body_spec(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    @app.post("/v1/completions", openapi_extra=_body_spec(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._surface(request)  # with auth on, listing models needs a key too
        except ClusterError as err:
            return error_response(err, _request_id(request))
        data = []
        for m in self.cfg.models:
            kinds = sorted({b.kind for b in self.cfg.backends if b.model == m.name})
            data.append(
                {
                    "id": m.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "llm-cluster",
                    "context_window": m.context_window,
                    "backend_kinds": kinds,
                    "simulated": "sim" in kinds,
                }
            )
        return JSONResponse({"object": "list", "data": data})

    @app.get("/healthz")
    async def healthz(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})
