"""A loopback server speaking Anthropic's Messages API: POST /v1/messages, streaming and not.

Streams are named SSE events: ``message_start``, ``content_block_start``, ``ping``,
``content_block_delta`` (``text_delta``, or ``input_json_delta`` in a ``tool_use`` block),
``content_block_stop``, ``message_delta`` (stop reason,
cumulative ``output_tokens``), ``message_stop``; a failure inside a stream is ``event: error`` with
``{"type": "error", "error": {"type", "message"}}``. HTTP errors use the same body and the real
statuses (429 with ``retry-after``, 529 ``overloaded_error``). Requests are validated as the real API
does for what adapters get wrong: ``anthropic-version`` header, ``max_tokens`` required, roles
only user/assistant, the first turn a user one, temperature within 0..1, and tools the way the API
checks them (:mod:`tests.servers.tools`: tool_use only in assistant turns, tool_result first in the
next user turn and naming a tool_use of the turn before). With tools it answers with ``tool_use``
blocks and ``stop_reason: tool_use``, after a tool result with text. ``cache_control`` breakpoints
cache prompt prefixes as the API documents (:mod:`tests.servers.prompt_cache`), reported in
``cache_creation_input_tokens`` / ``cache_read_input_tokens``. With ``thinking`` enabled the answer
starts with a signed thinking block (streamed as ``thinking_delta`` / ``signature_delta``), and
thinking blocks sent back are checked as the API checks them (:mod:`tests.servers.thinking`).

Standalone: ``python -m tests.servers.anthropic_server --port 8102 [--api-key-env VAR] [--fault SPEC]``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tests.servers import thinking as TH
from tests.servers import tools as T
from tests.servers.common import (
    Fault,
    LoopbackServer,
    RequestRecord,
    answer_tokens,
    count_prompt_tokens,
    main,
    sse,
)
from tests.servers.prompt_cache import AnthropicCache

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(type_: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": type_, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _validate(body: Any) -> str | None:
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if not isinstance(body.get("model"), str):
        return "model: Field required"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            return (
                f'messages.{i}.role: Unexpected role "{role}". The Messages API accepts a top-level '
                '`system` parameter, not "system" as an input message role.'
            )
        if not isinstance(m.get("content"), str | list):
            return f"messages.{i}.content: Field required"
    if messages[0]["role"] != "user":
        return 'messages: first message must use the "user" role'
    t = body.get("temperature")
    if t is not None and not (isinstance(t, int | float) and 0 <= t <= 1):
        return "temperature: Input should be less than or equal to 1"
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        return "system: Input should be a valid string or list"
    return T.anthropic_problem(body) or TH.problem(body)


@dataclass
class _Answer:
    tokens: list[str]
    stop_reason: str
    matched: str | None
    uses: list[dict[str, Any]]
    thought: dict[str, Any] | None  # the thinking block that comes first, when thinking is on


class AnthropicServer(LoopbackServer):
    name = "anthropic"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache = AnthropicCache()

    def reset(self) -> None:
        super().reset()
        self.cache.clear()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._messages)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self.run_handler(request, "/v1/messages", self._handle)

    def _error(self, rec: RequestRecord, status: int, message: str, headers: dict[str, str] | None = None):
        rec.outcome = f"status:{status}"
        rid = f"req_{rec.id}"
        body = error_body(ERROR_TYPES.get(status, "api_error"), message, rid)
        return web.json_response(body, status=status, headers={"request-id": rid, **(headers or {})})

    async def _handle(self, request: web.Request, rec: RequestRecord) -> web.StreamResponse:
        # The API takes the key as ``x-api-key`` or, as newer SDKs send it, a bearer token.
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix(
            "Bearer "
        )
        if self.api_key is not None and given != self.api_key:
            return self._error(rec, 401, "invalid x-api-key")
        if not request.headers.get("anthropic-version"):
            return self._error(rec, 400, "anthropic-version: header is required")
        try:
            body = await request.json()
        except ValueError:
            return self._error(rec, 400, "There was an issue with the request body: not valid JSON")
        problem = _validate(body)
        rec.body = body
        if problem:
            return self._error(rec, 400, problem)
        fault, answered = await self.early_fault(
            request, rec, body, lambda: self._error(rec, 400, f"x-api-key: invalid value {given!r}")
        )
        if answered is not None:
            return answered
        model = rec.model
        self._count_prompt(body, rec)
        answer = self._answer(body, fault)
        tokens, stop_reason, matched, uses, thought = (
            answer.tokens,
            answer.stop_reason,
            answer.matched,
            answer.uses,
            answer.thought,
        )
        ident = "msg_" + uuid.uuid4().hex[:24]
        if not body.get("stream"):
            if fault.slow_first_s:
                await asyncio.sleep(fault.slow_first_s)
            rec.completion_tokens = len(tokens) + 10 * len(uses) + (20 if thought else 0)
            return web.json_response(
                {
                    "id": ident,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [
                        *([thought] if thought else []),
                        {"type": "text", "text": "".join(tokens)},
                        *uses,
                    ],
                    "stop_reason": stop_reason,
                    "stop_sequence": matched,
                    "usage": self._usage(rec, rec.completion_tokens),
                },
                headers={"request-id": f"req_{rec.id}"},
            )
        return await self._stream(request, rec, fault, ident, model, answer)

    def _count_prompt(self, body: dict[str, Any], rec: RequestRecord) -> None:
        system = body.get("system")
        texts = [_text(m["content"]) for m in body["messages"]] + ([_text(system)] if system else [])
        use = self.cache.use(body)
        rec.prompt_tokens = max(count_prompt_tokens(texts), use.read + use.written)
        rec.cached_tokens, rec.cache_write_tokens = use.read, use.written

    def _answer(self, body: dict[str, Any], fault: Fault) -> _Answer:
        stop = list(body.get("stop_sequences") or [])
        n = min(body["max_tokens"], fault.tokens if fault.tokens is not None else self.output_tokens)
        tokens, matched = answer_tokens(n, stop)
        stop_reason = (
            "stop_sequence" if matched else "end_turn" if len(tokens) < body["max_tokens"] else "max_tokens"
        )
        calls = T.anthropic_calls(body)
        if calls:  # a short preamble, then the calls (as the documented example answers)
            tokens, matched, stop_reason = tokens[:2], None, "tool_use"
        uses = [
            {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": name, "input": args}
            for name, args in calls
        ]
        thought = TH.block(body) if TH.enabled(body) else None  # first, before text and tool use
        return _Answer(tokens, stop_reason, matched, uses, thought)

    def _usage(self, rec: RequestRecord, output: int) -> dict[str, Any]:
        return {
            "input_tokens": rec.prompt_tokens - rec.cached_tokens - rec.cache_write_tokens,
            "cache_creation_input_tokens": rec.cache_write_tokens,
            "cache_read_input_tokens": rec.cached_tokens,
            "output_tokens": output,
            "service_tier": "standard",
        }

    def _fault_status(self, rec: RequestRecord, fault: Fault) -> web.Response:
        s = fault.status or 500
        headers: dict[str, str] = {}
        message = {
            429: "Number of request tokens has exceeded your per-minute rate limit",
            529: "Overloaded",
            500: "Internal server error",
            404: f"model: {rec.model}",
        }.get(s, f"Loopback fault {s}: this request was refused on purpose.")
        if s == 429:
            headers = {"retry-after": f"{fault.retry_after:g}", "anthropic-ratelimit-requests-remaining": "0"}
        return self._error(rec, s, message, headers)

    async def _stream(
        self,
        request: web.Request,
        rec: RequestRecord,
        fault: Fault,
        ident: str,
        model: str,
        answer: _Answer,
    ) -> web.StreamResponse:
        tokens, stop_reason, matched, uses = answer.tokens, answer.stop_reason, answer.matched, answer.uses
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream; charset=utf-8",
                "cache-control": "no-cache",
                "request-id": f"req_{rec.id}",
            }
        )
        await resp.prepare(request)
        start = {
            "type": "message_start",
            "message": {
                "id": ident,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": self._usage(rec, 1),
            },
        }
        await resp.write(sse(start, "message_start"))
        at = await self._stream_thinking(resp, rec, answer.thought)  # the text block's index
        block = {"type": "content_block_start", "index": at, "content_block": {"type": "text", "text": ""}}
        await resp.write(sse(block, "content_block_start"))
        await resp.write(sse({"type": "ping"}, "ping"))

        def text_delta(tok: str) -> bytes:
            delta = {"type": "content_block_delta", "index": at, "delta": {"type": "text_delta", "text": tok}}
            return sse(delta, "content_block_delta")

        ended = await self.stream_tokens(request, resp, rec, fault, tokens, text_delta)
        if ended is not None:
            return ended
        await resp.write(sse({"type": "content_block_stop", "index": at}, "content_block_stop"))
        for i, use in enumerate(uses, start=at + 1):
            await self._stream_tool_use(resp, rec, i, use)
        md = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": matched},
            "usage": {"output_tokens": rec.completion_tokens},
        }
        await resp.write(sse(md, "message_delta"))
        if not fault.no_done:
            await resp.write(sse({"type": "message_stop"}, "message_stop"))
        await resp.write_eof()
        return resp

    async def _stream_thinking(
        self, resp: web.StreamResponse, rec: RequestRecord, block: dict[str, Any] | None
    ) -> int:
        """Block 0 as the API streams it: a thinking block opens empty, its text comes in
        ``thinking_delta`` pieces, then one ``signature_delta``; a redacted block comes whole.
        Returns the next block's index."""
        if block is None:
            return 0
        if block["type"] == "redacted_thinking":
            await resp.write(
                sse(
                    {"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start"
                )
            )
        else:
            start = {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": ""},
            }
            await resp.write(sse(start, "content_block_start"))
            deltas = [{"type": "thinking_delta", "thinking": p} for p in T.pieces(block["thinking"])]
            for d in [*deltas, {"type": "signature_delta", "signature": block["signature"]}]:
                await resp.write(
                    sse({"type": "content_block_delta", "index": 0, "delta": d}, "content_block_delta")
                )
                rec.completion_tokens += 1
        await resp.write(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        return 1

    async def _stream_tool_use(
        self, resp: web.StreamResponse, rec: RequestRecord, index: int, use: dict[str, Any]
    ) -> None:
        """A tool_use block as the API streams it: empty input at the start, then the input's JSON
        in ``input_json_delta`` pieces (the first one empty, as in the documented example)."""
        block = {"type": "content_block_start", "index": index, "content_block": {**use, "input": {}}}
        await resp.write(sse(block, "content_block_start"))
        for part in ["", *T.pieces(json.dumps(use["input"]))]:
            delta = {"type": "input_json_delta", "partial_json": part}
            await resp.write(
                sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            )
            rec.completion_tokens += 1
        await resp.write(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))

    def malformed_event(self) -> bytes:
        return b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "del\n\n'

    def error_event(self) -> bytes:
        return sse(error_body("overloaded_error", "Overloaded"), "error")


if __name__ == "__main__":
    main(AnthropicServer)
