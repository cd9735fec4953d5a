"""The floor of the shape our gateway is served in, for the overhead benchmark's ``floor`` leg.

Issue 13 has the gateway serve HTTP itself as a Ray Serve deployment (direct ingress) behind Serve's
HAProxy. What that shape costs before any gateway logic runs (HAProxy, Serve's uvicorn and its
per-request wrapper, an aiohttp client to the upstream, the writes back) is measured here with a
relay that has no logic at all: it reads the body, POSTs it to the upstream and passes the bytes back
as they arrive. No parse, no tokenizer, no admission, no race, no accounting, no metrics of ours.

It is deployed as a second app (``/floor``) into the same Ray cluster and behind the same HAProxy as
the ``ours`` leg, with the gateway's replica count, Serve options, environment and logging
(:func:`deploy_floor`), so the two legs differ in the gateway's code alone. Our gateway's added TTFT
minus the floor's is what our code costs; the floor's own added TTFT is what no gateway written this
way can go under on the machine at the time.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

from deployments.providers.provider_http import shared_session

Scope = dict[str, Any]


class PassThrough:
    """The relay as a plain ASGI 3 app (no Ray): POST bodies go to ``upstream``, its status, content
    type and body bytes come back as they arrive; any GET answers 200 (the readiness check)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await _answer(send, 200, b"ok")
            return
        body = bytearray()
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {"content-type": "application/json"}
        # the provider adapters' own pooled session: the ours leg reaches the upstream through it
        async with shared_session().post(self.upstream, data=bytes(body), headers=headers) as resp:
            ctype = resp.headers.get("content-type", "application/octet-stream").encode()
            head = [(b"content-type", ctype)]
            await send({"type": "http.response.start", "status": resp.status, "headers": head})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _answer(send: Any, status: int, body: bytes) -> None:
    head = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@serve.deployment(max_ongoing_requests=4096)  # the gateway's own (deployments/gateway/gateway.py)
@serve.ingress()
class FloorRelay:
    def __init__(self, upstream: str) -> None:
        self.relay = PassThrough(upstream)  # not `app`: serve.ingress owns that name

    def __serve_build_asgi_app__(self) -> Any:
        return self.relay


def deploy_floor(cfg: Any, upstream: str, timeout_s: float = 120.0) -> str:
    """Deploy :class:`FloorRelay` as app ``floor`` at ``/floor`` beside a cluster that
    ``deployments.launcher.local.start(cfg)`` started, with the gateway's options; returns its chat URL once
    HAProxy routes to it."""
    from deployments.app import gateway_options
    from deployments.launcher.local import _wait_routed, _wait_running

    app = FloorRelay.options(**gateway_options(cfg)).bind(upstream)
    serve.run(app, name="floor", route_prefix="/floor", blocking=False)
    deadline = time.monotonic() + timeout_s
    base = f"http://{cfg.server.host}:{cfg.server.port}/floor"
    _wait_running("floor", deadline)
    _wait_routed(f"{base}/healthz", deadline)
    return f"{base}/v1/chat/completions"
