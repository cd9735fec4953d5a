"""The load tests' one SSE reader (loadtest/common/client.py, on the project's SSE decoder) and the runner's
timing of one streamed request over it, against canned byte streams split at awkward places."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from loadtest.common.client import EventStream
from loadtest.common.request_spec import RequestSpec
from loadtest.common.runner import stream_one


def _sse(*objs: object, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(o).encode() + b"\r\n\r\n" for o in objs)
    return body + (b": keep-alive\n\ndata: [DONE]\n\n" if done else b"")


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), self.size):
            yield self.data[i : i + self.size]


def _client(status: int, data: bytes, size: int = 7) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=_Chunks(data, size), headers={"x-llmc-replica": "r-1"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _delta(text: str) -> dict:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": text}}]}


def test_events_up_to_done_whatever_the_chunking() -> None:
    data = _sse(_delta("héllo"), _delta("wörld")) + b'data: {"after": "done"}\n\n'
    for size in (1, 3, 7, len(data)):
        events = EventStream()
        got = [json.loads(d) for d in events.iter(data[i : i + size] for i in range(0, len(data), size))]
        assert got == [_delta("héllo"), _delta("wörld")] and events.done, size
    cut = EventStream()
    assert [json.loads(d) for d in cut.iter([_sse(_delta("x"), done=False)])] == [_delta("x")]
    assert not cut.done  # closed without [DONE]


def test_stream_one_times_tokens_and_takes_the_usage() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    usage["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}  # type: ignore[index]
    data = _sse({"choices": [{"delta": {"role": "assistant"}}]}, _delta("a"), _delta("b"), usage)
    spec = RequestSpec(surface="chat", kind="chat", session_id="s", turn=0, max_tokens=8, messages=[])

    async def go() -> object:
        async with _client(200, data) as c:
            return await stream_one(c, "http://gw", "m", spec, 0.0)

    res = asyncio.run(go())
    assert res.status == "ok" and res.error is None and res.replica == "r-1"  # type: ignore[attr-defined]
    assert res.ttft_s is not None and len(res.gaps_s) == 1  # type: ignore[attr-defined]
    assert (res.output_tokens, res.prompt_tokens, res.cached_tokens) == (3, 9, 4)  # type: ignore[attr-defined]


def test_stream_one_reports_http_and_in_stream_errors() -> None:
    spec = RequestSpec(surface="tab", kind="completion", session_id="s", turn=0, max_tokens=8, prompt="x")
    err = {"error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limit_exceeded"}}

    async def go(status: int, data: bytes) -> object:
        async with _client(status, data) as c:
            return await stream_one(c, "http://gw", "m", spec, 0.0)

    r429 = asyncio.run(go(429, json.dumps(err).encode()))
    assert (r429.status, r429.error) == ("error", "http_429:rate_limit_exceeded")  # type: ignore[attr-defined]
    mid = asyncio.run(go(200, _sse({"choices": [{"text": "a"}]}, {"error": {"code": "stream_interrupted"}})))
    assert (mid.status, mid.error, mid.output_tokens) == ("error", "stream:stream_interrupted", 1)  # type: ignore[attr-defined]
