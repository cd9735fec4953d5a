"""``POST /v1/messages`` (Anthropic-compatible) as a thin shell over the gateway's chat route.

The Messages body is translated into the OpenAI chat body (:mod:`cluster.messages_api`) and served
by the gateway's own chat completions path, so admission, affinity, failover and the relay are the
same; what the route writes back is translated on the way out (:mod:`cluster.messages_stream` for
streams, the whole response or error otherwise). Anthropic clients send their key as
``x-api-key``: it stands in for ``Authorization: Bearer`` here.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from cluster import messages_api
from cluster.errors import ClusterError
from cluster.messages_stream import MessagesStream
from deployments import http_api as h

Route = Callable[[h.Scope, h.Receive, h.Send], Awaitable[None]]


def _scope(scope: h.Scope, length: int) -> h.Scope:
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"authorization")]
    auth = h.header(scope, b"authorization")
    key = h.header(scope, b"x-api-key")
    if auth is None and key is not None:
        auth = f"Bearer {key}"
    if auth is not None:
        headers.append((b"authorization", auth.encode("latin-1")))
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


async def _error(send: h.Send, err: ClusterError) -> None:
    await h.send_json(
        send, err.status_code, messages_api.error_body(err.status_code, err.to_openai()), err.headers()
    )


async def messages(chat: Route, limit: int, scope: h.Scope, receive: h.Receive, send: h.Send) -> None:
    try:
        h.check_json_content_type(scope)
        raw = await h.read_body(scope, receive, limit)
        body = h.parse_json(raw)
        translated = json.dumps(messages_api.to_chat(body)).encode()
    except ClusterError as err:
        await _error(send, err)
        return
    except ConnectionResetError:
        return
    model = str(body.get("model", ""))
    sent = False

    async def inner_receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()  # a disconnect, as the chat route watches for it
        sent = True
        return {"type": "http.request", "body": translated, "more_body": False}

    await chat(_scope(scope, len(translated)), inner_receive, _Translating(send, model))


class _Translating:
    """A ``send`` that turns the chat route's answer into the Messages API's."""

    def __init__(self, send: h.Send, model: str) -> None:
        self.send = send
        self.model = model
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.stream: MessagesStream | None = None
        self.buf = bytearray()

    async def __call__(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = [(k, v) for k, v in msg.get("headers", []) if k != b"content-length"]
            if (dict(self.headers).get(b"content-type") or b"").startswith(b"text/event-stream"):
                self.stream = MessagesStream(self.model)
                await self.send({**msg, "headers": self.headers})
            return
        body = msg.get("body", b"")
        more = msg.get("more_body", False)
        if self.stream is not None:
            out = self.stream.feed(body)
            if out or not more:
                await self.send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self.buf += body
        if more:
            return
        obj = json.loads(bytes(self.buf) or b"{}")
        if self.status == 200:
            obj = messages_api.from_chat(obj, self.model)
        else:
            obj = messages_api.error_body(self.status, obj)
        data = json.dumps(obj, separators=(",", ":")).encode()
        headers = [*self.headers, (b"content-length", str(len(data)).encode())]
        await self.send({"type": "http.response.start", "status": self.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": data})
