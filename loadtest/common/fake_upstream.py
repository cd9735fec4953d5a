"""A fake OpenAI-compatible upstream that answers at once: the floor the overhead benchmark measures from.

    python -m loadtest.common.fake_upstream --port 8101 [--host 127.0.0.1] [--chunks 32] [--interval-ms 0]

``POST /v1/chat/completions`` with ``stream: true`` answers with ``--chunks`` ``data:
{chat.completion.chunk}`` events (one content token each; the first also carries the role, the last
the ``finish_reason``), then, when ``stream_options.include_usage`` is set, a chunk with empty
``choices`` and the usage (every other chunk then carries ``"usage": null``, as the real API does),
then ``data: [DONE]``. Each event is its own write (the server sets TCP_NODELAY), so a relay sees
chunks the way a real engine sends them, only without the wait between tokens (``--interval-ms``
paces the content chunks that far apart, on a fixed schedule from the first: a decoding engine's
per-stream speed, for the relay benchmark :mod:`loadtest.benchmarks.bench_relay`). Without ``stream``
the same answer comes as one ``chat.completion`` object. The model name is echoed.

So that ``vllm-router`` accepts it as a worker it also answers ``GET /health`` (200), ``/v1/models``,
``/version``, ``/get_server_info``, ``/get_model_info`` and ``/metrics``. No auth, no validation
beyond what the answer needs, no logging: the cheapest honest server aiohttp can be.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from typing import Any

from aiohttp import web

CHUNKS = 32
MODEL = "bench-model"
VERSION = "0.0.0-fake"
_ID = b"@@ID@@"
_seq = itertools.count()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(i: int) -> str:
    return "Hello" if i == 0 else f" tok{i}"


def stream_events(
    model: str, chunks: int = CHUNKS, include_usage: bool = False, created: int = 0
) -> list[bytes]:
    """The SSE events of one streamed answer, with ``@@ID@@`` where the completion id goes."""
    base: dict[str, Any] = {"id": _ID.decode(), "object": "chat.completion.chunk", "created": created}
    base["model"] = model
    events = []
    for i in range(chunks):
        delta = {"role": "assistant", "content": token_text(i)} if i == 0 else {"content": token_text(i)}
        choice = {"index": 0, "delta": delta, "logprobs": None}
        choice["finish_reason"] = "stop" if i == chunks - 1 else None
        chunk = {**base, "choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    if include_usage:
        chunk = {**base, "choices": [], "usage": _usage(0, chunks)}
        events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def completion(model: str, rid: str, chunks: int = CHUNKS, prompt_tokens: int = 0) -> dict[str, Any]:
    """The non-streamed answer: the same text as one ``chat.completion``."""
    text = "".join(token_text(i) for i in range(chunks))
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": _usage(prompt_tokens, chunks),
    }


def _prompt_tokens(body: dict[str, Any]) -> int:
    chars = sum(len(m.get("content") or "") for m in body.get("messages") or [] if isinstance(m, dict))
    return max(1, chars // 4)


class FakeUpstream:
    def __init__(self, chunks: int = CHUNKS, interval_s: float = 0.0) -> None:
        self.chunks = chunks
        self.interval_s = interval_s  # between content chunks (0: written at once)
        self._templates: dict[tuple[str, bool], list[bytes]] = {}

    def _events(self, model: str, include_usage: bool) -> list[bytes]:
        key = (model, include_usage)
        if key not in self._templates:
            self._templates[key] = stream_events(model, self.chunks, include_usage, int(time.time()))
        return self._templates[key]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response(
                {"error": {"message": "invalid JSON", "type": "invalid_request_error"}}, status=400
            )
        model = str(body.get("model") or MODEL)
        rid = f"chatcmpl-fake{next(_seq):012d}"
        if not body.get("stream"):
            return web.json_response(completion(model, rid, self.chunks, _prompt_tokens(body)))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid_b = rid.encode()
        step, t0 = self.interval_s, time.monotonic()
        for i, event in enumerate(self._events(model, include_usage)):
            if step and 0 < i < self.chunks:  # on schedule: a late write does not delay the next
                await asyncio.sleep(max(0.0, t0 + i * step - time.monotonic()))
            await resp.write(event.replace(_ID, rid_b))
        await resp.write_eof()
        return resp


def build_app(chunks: int = CHUNKS, interval_s: float = 0.0) -> web.Application:
    up = FakeUpstream(chunks, interval_s)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "fake", "max_model_len": 8192}
        return web.json_response({"object": "list", "data": [card]})

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"version": VERSION, "model_path": MODEL, "served_model_name": MODEL})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "is_generation": True, "max_model_len": 8192})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="# fake upstream: no metrics\n", content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", up.chat)
    for path, handler in (
        ("/health", health),
        ("/v1/models", models),
        ("/version", version),
        ("/get_server_info", server_info),
        ("/get_model_info", model_info),
        ("/metrics", metrics),
    ):
        app.router.add_get(path, handler)
    return app


def _loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--chunks", type=int, default=CHUNKS, help="content chunks per streamed answer")
    ap.add_argument("--interval-ms", type=float, default=0.0, help="between content chunks (0: at once)")
    args = ap.parse_args(argv)
    web.run_app(
        build_app(args.chunks, args.interval_ms / 1000.0),
        backlog=4096,  # hundreds of streams connect at once: the default 128 drops SYNs (1 s retries)
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=_loop(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
