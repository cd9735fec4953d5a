"""A loopback server speaking OpenAI's /v1/chat/completions, /v1/completions and /v1/models.

Streams are ``data: {chunk}\\n\\n`` lines ending in ``data: [DONE]``; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk with empty
``choices`` carries the usage, as the real API does. With ``tools`` it answers with ``tool_calls``
(streamed as ``delta.tool_calls`` pieces by index) and ``finish_reason: tool_calls``
(:mod:`tests.servers.tools`). Prompts of 1,024 tokens or more are cached automatically, as the real
API does, and a shared prefix is reported in ``prompt_tokens_details.cached_tokens``
(:mod:`tests.servers.prompt_cache`). Errors are ``{"error": {message, type, param,
code}}`` with the real statuses and headers. Faults: see :mod:`tests.servers.common`.

Standalone: ``python -m tests.servers.openai_server --port 8101 [--api-key-env VAR] [--fault SPEC]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

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
from tests.servers.prompt_cache import OpenAICache

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "requests",
}
FINGERPRINT = "fp_loopback01"


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


class OpenAIServer(LoopbackServer):
    name = "openai"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache = OpenAICache()

    def reset(self) -> None:
        super().reset()
        self.cache.clear()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "gpt-test", "object": "model", "created": 0, "owned_by": "loopback"}],
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.run_handler(request, "/v1/chat/completions", self._chat_body)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.run_handler(request, "/v1/completions", self._completion_body)

    # ------------------------------------------------------------------------------------------
    def _error(
        self, rec: RequestRecord, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ):
        rec.outcome = f"status:{status}"
        h = {"x-request-id": f"req_{rec.id}", **(headers or {})}
        return web.json_response(body, status=status, headers=h)

    async def _common(
        self, request: web.Request, rec: RequestRecord
    ) -> tuple[dict[str, Any], Fault] | web.Response:
        if self.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {self.api_key}":
                given = auth.removeprefix("Bearer ")
                # Like the real API: the message echoes a masked key.
                masked = f"{given[:3]}{'*' * max(0, len(given) - 7)}{given[-4:]}" if given else ""
                msg = f"Incorrect API key provided: {masked}. You can find your API key at the dashboard."
                return self._error(rec, 401, error_body(msg, "invalid_request_error", "invalid_api_key"))
        try:
            body = await request.json()
        except ValueError:
            return self._error(
                rec,
                400,
                error_body("We could not parse the JSON body of your request.", "invalid_request_error"),
            )
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return self._error(
                rec, 400, error_body("you must provide a model parameter", "invalid_request_error")
            )
        rec.body = body

        def echo_key() -> web.Response:
            msg = f"Invalid header value: {request.headers.get('authorization', '')!r}"
            return self._error(rec, 400, error_body(msg, "invalid_request_error"))

        fault, answered = await self.early_fault(request, rec, body, echo_key)
        return answered if answered is not None else (body, fault)

    def _fault_status(self, rec: RequestRecord, fault: Fault) -> web.Response:
        s = fault.status or 500
        if s == 429:
            msg = (
                f"Rate limit reached for {rec.model} in organization org-loopback on requests per min (RPM): "
                f"Limit 3, Used 3, Requested 1. Please try again in {fault.retry_after:g}s."
            )
            headers = {
                "retry-after": f"{fault.retry_after:g}",
                "retry-after-ms": str(int(fault.retry_after * 1000)),
                "x-ratelimit-limit-requests": "3",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": f"{fault.retry_after:g}s",
            }
            return self._error(rec, 429, error_body(msg, "requests", "rate_limit_exceeded"), headers)
        if s == 404:
            msg = f"The model `{rec.model}` does not exist or you do not have access to it."
            return self._error(rec, 404, error_body(msg, "invalid_request_error", "model_not_found"))
        if s >= 500:
            msg = "The server had an error while processing your request. Sorry about that!"
            return self._error(rec, s, error_body(msg, "server_error"))
        if s == 401:
            msg = "Incorrect API key provided: sk-****. You can find your API key at the dashboard."
            return self._error(rec, 401, error_body(msg, "invalid_request_error", "invalid_api_key"))
        msg = f"Loopback fault {s}: this request was refused on purpose."
        return self._error(
            rec, s, error_body(msg, ERROR_TYPES.get(s, "invalid_request_error"), param="messages")
        )

    async def _chat_body(self, request: web.Request, rec: RequestRecord) -> web.StreamResponse:
        got = await self._common(request, rec)
        if isinstance(got, web.StreamResponse):
            return got
        body, fault = got
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._error(
                rec,
                400,
                error_body("'messages' must be a non-empty array", "invalid_request_error", param="messages"),
            )
        rec.prompt_tokens = count_prompt_tokens([_content_text(m.get("content")) for m in messages])
        prefix = json.dumps([body.get("tools"), messages], sort_keys=True)
        rec.cached_tokens = self.cache.use(prefix, rec.prompt_tokens)
        return await self._answer(request, rec, body, fault, chat=True)

    async def _completion_body(self, request: web.Request, rec: RequestRecord) -> web.StreamResponse:
        got = await self._common(request, rec)
        if isinstance(got, web.StreamResponse):
            return got
        body, fault = got
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return self._error(
                rec, 400, error_body("'prompt' must be a string", "invalid_request_error", param="prompt")
            )
        rec.prompt_tokens = count_prompt_tokens([prompt]) - 6
        rec.cached_tokens = self.cache.use(prompt, rec.prompt_tokens)
        return await self._answer(request, rec, body, fault, chat=False)

    async def _answer(
        self, request: web.Request, rec: RequestRecord, body: dict[str, Any], fault: Fault, *, chat: bool
    ) -> web.StreamResponse:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 4096
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        n = min(int(max_tokens), fault.tokens if fault.tokens is not None else self.output_tokens)
        tokens, matched = answer_tokens(n, stop)
        finish = "stop" if matched or len(tokens) < int(max_tokens) else "length"
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        calls = T.openai_calls(body) if chat else []
        tool_calls = T.openai_tool_calls(calls, ["call_" + uuid.uuid4().hex[:24] for _ in calls])
        if tool_calls:
            tokens, finish = [], "tool_calls"
        if not body.get("stream"):
            if fault.slow_first_s:
                await asyncio.sleep(fault.slow_first_s)
            rec.completion_tokens = len(tokens) + 10 * len(tool_calls)
            full = self._full(ident, created, rec, "".join(tokens), finish, chat)
            if tool_calls:
                full["choices"][0]["message"].update(content=None, tool_calls=tool_calls)
            return web.json_response(full)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream; charset=utf-8",
                "cache-control": "no-cache",
                "x-request-id": f"req_{rec.id}",
                "openai-processing-ms": "1",
            }
        )
        await resp.prepare(request)
        asked = body.get("top_logprobs", 0) if chat and body.get("logprobs") else body.get("logprobs")
        offset = [0]  # a completion's text_offset so far

        def chunk(delta_text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta = {"role": "assistant", "content": "", "refusal": None}
                elif delta_text is not None:
                    delta = {"content": delta_text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                obj: dict[str, Any] = {
                    "id": ident,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": rec.model,
                    "service_tier": "default",
                    "system_fingerprint": FINGERPRINT,
                    "choices": [choice],
                }
            else:
                choice = {
                    "text": delta_text or "",
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
                obj = {
                    "id": ident,
                    "object": "text_completion",
                    "created": created,
                    "choices": [choice],
                    "model": rec.model,
                    "system_fingerprint": FINGERPRINT,
                }
            if asked is not None and asked is not False and delta_text:
                choice["logprobs"] = _logprobs(delta_text, int(asked), chat, offset)
            if include_usage:
                obj["usage"] = None
            return obj

        if chat:
            await resp.write(sse(chunk(None, None, role=True)))
        ended = await self.stream_tokens(request, resp, rec, fault, tokens, lambda tok: sse(chunk(tok, None)))
        if ended is not None:
            return ended
        # n: more choices (the tokens reversed), each whole, before the first one's finish
        for i in range(1, int(body.get("n") or 1)):
            more = [chunk(None, None, role=True)] if chat else []
            more += [chunk(t, None) for t in reversed(tokens)] + [chunk(None if chat else "", finish)]
            for obj in more:
                obj["choices"][0]["index"] = i
                await resp.write(sse(obj))
            rec.completion_tokens += len(tokens)
        for i, call in enumerate(tool_calls):
            for j, part in enumerate(T.pieces(call["function"]["arguments"])):
                piece: dict[str, Any] = {"index": i, "function": {"arguments": part}}
                if j == 0:
                    piece = {"index": i, "id": call["id"], "type": "function",
                             "function": {"name": call["function"]["name"], "arguments": ""}}  # fmt: skip
                    obj = chunk(None, None)
                    obj["choices"][0]["delta"] = {"tool_calls": [piece]}
                    await resp.write(sse(obj))
                    piece = {"index": i, "function": {"arguments": part}}
                obj = chunk(None, None)
                obj["choices"][0]["delta"] = {"tool_calls": [piece]}
                await resp.write(sse(obj))
                rec.completion_tokens += 1
        await resp.write(sse(chunk(None if chat else "", finish)))
        if include_usage and not fault.no_usage:
            last = chunk(None, None)
            last["choices"] = []
            last["usage"] = _usage(rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens)
            await resp.write(sse(last))
        if not fault.no_done:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def malformed_event(self) -> bytes:
        return b'data: {"id": "chatcmpl-broken", "choices": [{"delta": {"content": "oops\n\n'

    def error_event(self) -> bytes:
        err = error_body(
            "The server had an error while processing your request. Sorry about that!", "server_error"
        )
        return f"data: {json.dumps(err)}\n\n".encode()

    def _full(
        self, ident: str, created: int, rec: RequestRecord, text: str, finish: str, chat: bool
    ) -> dict[str, Any]:
        usage = _usage(rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens)
        if chat:
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": []}
            return {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": rec.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
                "service_tier": "default",
                "system_fingerprint": FINGERPRINT,
            }
        return {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": rec.model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
            "usage": usage,
            "system_fingerprint": FINGERPRINT,
        }


if __name__ == "__main__":
    main(OpenAIServer)


def _logprobs(token: str, k: int, chat: bool, offset: list[int]) -> dict[str, Any]:
    """A streamed token's ``logprobs`` as OpenAI writes them (made-up values: the token first)."""
    top = [(token, -0.25), *((f"alt{i}", -1.0 - i) for i in range(1, k))][:k]
    if chat:
        item = {"token": token, "logprob": -0.25, "bytes": list(token.encode())}
        tops = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]
        return {"content": [{**item, "top_logprobs": tops}], "refusal": None}
    at, offset[0] = offset[0], offset[0] + len(token)
    return {"tokens": [token], "token_logprobs": [-0.25], "top_logprobs": [dict(top)], "text_offset": [at]}
