"""What the gateway refuses before Ray Serve's direct ingress reads a request's headers.

Serve's direct ingress (``ray/serve/_private/replica.py``, ``_direct_ingress_asgi``) decodes a few
headers as UTF-8 before our ASGI app runs: ``x-request-id``, ``x-session-id``, its timeout and
disconnect headers, the multiplexed model id, the trace context. A non-UTF-8 byte in one of them
raised there, and uvicorn answered a plain-text 500 with nothing logged. Serve also echoes the
client's ``x-request-id`` whatever its length (a 15 KB id came back whole in every response).

:class:`HeaderGuard` runs first, outside Serve's own request-id middleware: Serve applies the
middlewares that ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names (``middlewares`` below) around
its direct-ingress app, and the gateway deployment sets that variable
(:data:`cluster.dataplane.GATEWAY_ENV`). It answers such a request with an OpenAI 400 (one
``x-request-id`` of ours: the client's is the problem) and lets every other one through untouched,
at the cost of a look at each header's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable

from starlette.middleware import Middleware

from cluster.wire.errors import InvalidRequest, Overloaded
from deployments.gateway import http_api as h

# Longer ids are refused (a 400), not cut or replaced: the client learns at once that its id is
# not echoed, instead of correlating on an id that is not its own. UUIDs, W3C trace ids and
# the usual vendor request ids are well under it.
MAX_REQUEST_ID = 256
# The headers Serve's direct ingress decodes as UTF-8 (its session header's name with "_" or "-").
UTF8_HEADERS = frozenset(
    {
        b"x-request-id",
        b"x-session-id",
        b"x_session_id",
        b"x-request-timeout-seconds",
        b"x-request-disconnect-disabled",
        b"serve_multiplexed_model_id",
        b"serve-multiplexed-model-id",
        b"traceparent",
        b"tracestate",
    }
)


# Serve's own per-request controls, which a client must not set: a timeout of 0 or less turns
# Serve's request timeout off, and "disconnect disabled" keeps the request generating (and billing
# the upstream) after its client left. Dropped from every request before Serve reads them.
SERVE_CONTROLS = frozenset({b"x-request-timeout-seconds", b"x-request-disconnect-disabled"})


def without_serve_controls(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]] | None:
    """The headers less Serve's controls, or None when there were none (the common case)."""
    if not any(name in SERVE_CONTROLS for name, _ in headers):
        return None
    return [(n, v) for n, v in headers if n not in SERVE_CONTROLS]


def refusal(headers: list[tuple[bytes, bytes]]) -> InvalidRequest | None:
    """The 400 for a request whose headers Serve would fail on or echo whole; None: let it through."""
    for name, value in headers:
        if name not in UTF8_HEADERS:
            continue
        shown = name.decode("latin-1")
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return InvalidRequest(f"The {shown} header is not valid UTF-8.", param=shown)
        if name == b"x-request-id" and len(value) > MAX_REQUEST_ID:
            return InvalidRequest(
                f"The x-request-id header is {len(value)} bytes long; at most {MAX_REQUEST_ID} are accepted.",
                param=shown,
            )
    return None


class HeaderGuard:
    """ASGI middleware: :func:`refusal`'s 400 before Serve's direct ingress sees the request."""

    def __init__(self, app: h.App) -> None:
        self.app = app

    async def __call__(self, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
        if scope["type"] == "http":
            err = refusal(scope["headers"])
            if err is not None:
                ours = {"x-request-id": h.new_request_id()}
                await h.send_json(send, err.status_code, err.to_openai(), ours)
                return
            kept = without_serve_controls(scope["headers"])
            if kept is not None:
                scope = {**scope, "headers": kept}
            await _answering_any_exit(self.app, scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _answering_any_exit(app: h.App, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
    """``app`` on one request; if it exits with no response started (Serve's direct ingress itself
    raising while the replica is killed or shut down, outside the gateway's own handler), the
    client gets the gateway's 503 with Retry-After instead of uvicorn's plain-text 500."""
    started = False

    def tracking(message: h.Message) -> Awaitable[None]:
        # a plain call handing back send's awaitable: no coroutine frame of its own per chunk
        nonlocal started
        started = started or message.get("type") == "http.response.start"
        return send(message)

    try:
        await app(scope, receive, tracking)
    except BaseException:
        if not started:
            with contextlib.suppress(Exception):
                err = Overloaded("The gateway replica is shutting down; retry.", retry_after_s=1)
                ours = {**err.headers(), "x-request-id": h.new_request_id()}
                await h.send_json(send, err.status_code, err.to_openai(), ours)
        raise


def middlewares() -> list[Middleware]:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: Serve calls it in the gateway's
    process as its direct-ingress server starts."""
    return [Middleware(HeaderGuard)]
