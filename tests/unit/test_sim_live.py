"""The simulated-replica benchmarks' live client against a real streamed answer over loopback (the
overhead benchmark's fake upstream): what it records of one request."""

from __future__ import annotations

import httpx
from aiohttp import web

from loadtest.fake_upstream import build_app
from loadtest.request_spec import RequestSpec
from loadtest.sim_live import Result, stream_chat


async def test_stream_chat_records_ttft_tokens_usage_and_finish() -> None:
    runner = web.AppRunner(build_app(chunks=5))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    spec = RequestSpec(
        arrival_s=0.0,
        session_id="s1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        surface="tab",
    )
    res = Result(0, "s1", "tab")
    try:
        async with httpx.AsyncClient() as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await stream_chat(client, url, spec, res, 0.0, timeout_s=30)
    finally:
        await runner.cleanup()
    assert res.status == 200 and res.error is None and not res.hung, res
    assert res.ttft_s is not None and res.latency_s is not None and res.ttft_s <= res.latency_s
    assert res.output_tokens == 5  # the usage chunk's completion_tokens
    assert res.finish_reason == "stop"
