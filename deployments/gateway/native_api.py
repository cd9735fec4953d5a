"""``POST /v1/messages`` (Anthropic-compatible) and ``POST /v1/responses`` (OpenAI Responses, minimal)
as thin shells over the gateway's chat route, and ``POST /v1/messages/count_tokens`` over its
tokenization.

The body is translated into the OpenAI chat body (:mod:`cluster.wire.messages_api`,
:mod:`cluster.wire.responses_api`) and served by the gateway's own chat completions path, so admission,
affinity, failover and the relay are the same; what that route writes back is translated on the
way out (a stream event by event, a whole response or an error at once). Anthropic clients send
their key as ``x-api-key``: it stands in for ``Authorization: Bearer`` here.

The key is checked before the body is read, parsed or translated, as on the chat route. The body
limit applies to the client's bytes; the translation is written with its non-ASCII text as is
(``ensure_ascii`` would write a 3-byte character as a 6-byte escape, so a legal body could grow
past the limit) and is not measured again.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from cluster.json_types import JSON, JSONObject
from cluster.wire import messages_api, responses_api
from cluster.wire.errors import ClusterError
from cluster.wire.messages_stream import MessagesStream
from cluster.wire.responses_stream import ResponsesStream
from deployments.gateway import http_api as h

Route = Callable[[h.Scope, h.Receive, h.Send], Awaitable[None]]
Authorize = Callable[[h.Scope], object]  # raises the route's 401 (or 400) for a caller it refuses


class Translator(Protocol):
    """A streamed answer's translation (:class:`MessagesStream`, :class:`ResponsesStream`)."""

    def feed(self, data: bytes) -> bytes: ...


@dataclass(frozen=True)
class NativeApi:
    """One client API over the chat route: its request translation and its answer's."""

    to_chat: Callable[[JSON], JSONObject]  # the client's body -> the chat route's
    whole: Callable[[JSONObject, str], JSONObject]  # a whole chat answer, for a model -> the client's
    error: Callable[[int, JSON], JSON]  # status, the chat route's error body -> the client's
    stream: Callable[[str], Translator]  # model -> the answer's stream translator


MESSAGES = NativeApi(messages_api.to_chat, messages_api.from_chat, messages_api.error_body, MessagesStream)
RESPONSES = NativeApi(
    responses_api.to_chat, responses_api.from_chat, lambda status, obj: obj, ResponsesStream
)


def _scope(scope: h.Scope) -> h.Scope:
    """The chat route's scope: ``x-api-key`` as the bearer key, no content length (yet)."""
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"authorization")]
    auth = h.header(scope, b"authorization")
    key = h.header(scope, b"x-api-key")
    if auth is None and key is not None:
        auth = f"Bearer {key}"
    if auth is not None:
        headers.append((b"authorization", auth.encode("latin-1")))
    return {**scope, "headers": headers}


async def _client_body(
    inner: h.Scope,
    authorize: Authorize,
    scope: h.Scope,
    receive: h.Receive,
    limit: int,
    body_timeout_s: float | None,
) -> JSON:
    """The caller's key first, as the chat route checks it (nothing of a refused caller's is read),
    then its JSON body, within the size limit and the body deadline."""
    authorize(inner)
    h.check_json_content_type(scope)
    return h.parse_json(await h.read_body(scope, receive, limit, body_timeout_s))


async def serve(
    api: NativeApi,
    chat: Route,
    limit: int,
    authorize: Authorize,
    scope: h.Scope,
    receive: h.Receive,
    send: h.Send,
    body_timeout_s: float | None = None,
) -> None:
    inner = _scope(scope)
    try:
        body = await _client_body(inner, authorize, scope, receive, limit, body_timeout_s)
        translated = json.dumps(api.to_chat(body), ensure_ascii=False).encode()
    except ClusterError as err:
        await h.send_json(send, err.status_code, api.error(err.status_code, err.to_openai()), err.headers())
        return
    except ConnectionResetError:
        return
    sent = False

    async def inner_receive() -> h.Message:
        nonlocal sent
        if sent:
            return await receive()  # a disconnect, as the chat route watches for it
        sent = True
        return {"type": "http.request", "body": translated, "more_body": False}

    inner["headers"].append((b"content-length", str(len(translated)).encode()))
    await chat(inner, inner_receive, _Translating(api, send, str(body.get("model", ""))))


async def count_tokens(
    count: Callable[[bytes], Awaitable[int]],
    limit: int,
    authorize: Authorize,
    scope: h.Scope,
    receive: h.Receive,
    send: h.Send,
    body_timeout_s: float | None = None,
) -> None:
    """``POST /v1/messages/count_tokens``: the body translated as ``/v1/messages`` translates it,
    its prompt counted by ``count`` (the gateway's own tokenization of that chat body) and answered
    as ``{"input_tokens": N}``; the same key check first, the same errors in Anthropic's shape. No
    admission, no backend."""
    try:
        body = await _client_body(_scope(scope), authorize, scope, receive, limit, body_timeout_s)
        chat = json.dumps(messages_api.count_tokens_to_chat(body), ensure_ascii=False).encode()
        n = await count(chat)
    except ClusterError as err:
        body = messages_api.error_body(err.status_code, err.to_openai())
        await h.send_json(send, err.status_code, body, err.headers())
        return
    except ConnectionResetError:
        return
    await h.send_json(send, 200, {"input_tokens": n})


class _Translating:
    """A ``send`` that turns the chat route's answer into the client API's."""

    def __init__(self, api: NativeApi, send: h.Send, model: str) -> None:
        self.api = api
        self.send = send
        self.model = model
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.stream: Translator | None = None
        self.buf = bytearray()

    async def __call__(self, msg: h.Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = [(k, v) for k, v in msg.get("headers", []) if k != b"content-length"]
            if (dict(self.headers).get(b"content-type") or b"").startswith(b"text/event-stream"):
                self.stream = self.api.stream(self.model)
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
        obj = self.api.whole(obj, self.model) if self.status == 200 else self.api.error(self.status, obj)
        data = json.dumps(obj, separators=(",", ":")).encode()
        headers = [*self.headers, (b"content-length", str(len(data)).encode())]
        await self.send({"type": "http.response.start", "status": self.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": data})
