"""The simulated-replica benchmarks' live client against a real streamed answer over loopback (the
overhead benchmark's fake upstream): what it records of one request."""

from __future__ import annotations

from aiohttp import web

from loadtest.common.fake_upstream import build_app
from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import Result, session, stream_chat, warm_up


async def _serve(chunks: int = 1, app: web.Application | None = None) -> tuple[web.AppRunner, int]:
    """The fake upstream (or ``app``) on a free loopback port: its runner and the port."""
    runner = web.AppRunner(app if app is not None else build_app(chunks=chunks))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_warm_up_sends_its_requests_and_raises_nothing_when_they_succeed() -> None:
    """bench_affinity, bench_overload and bench_overload_shared all start with it: after the
    RequestSpec change it built its spec positionally and every one of them failed at once."""
    runner, port = await _serve(2)
    try:
        await warm_up(f"http://127.0.0.1:{port}/v1/chat/completions", 3)
    finally:
        await runner.cleanup()


async def test_stream_chat_records_ttft_tokens_usage_and_finish() -> None:
    runner, port = await _serve(5)
    spec = RequestSpec(
        arrival_s=0.0,
        session_id="s1",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        surface="tab",
    )
    res = Result(0, "s1", "tab")
    try:
        async with session(30) as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await stream_chat(client, url, spec, res, 0.0, timeout_s=30)
    finally:
        await runner.cleanup()
    assert res.status == 200 and res.error is None and not res.hung, res
    assert res.ttft_s is not None and res.latency_s is not None and res.ttft_s <= res.latency_s
    assert res.output_tokens == 5  # the usage chunk's completion_tokens
    assert res.finish_reason == "stop"


async def test_open_connections_leaves_that_many_keep_alive_connections_in_the_pool() -> None:
    from loadtest.common.sim_live import open_connections

    peers: set[int] = set()

    async def models(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_get("/x/v1/models", models)  # beside the completions URL, under its prefix
    runner, port = await _serve(app=app)
    try:
        async with session(10.0) as client:
            await open_connections(client, f"http://127.0.0.1:{port}/x/v1/chat/completions", 8)
            assert len(peers) == 8  # eight connections, each from its own port
            await open_connections(client, f"http://127.0.0.1:{port}/x/v1/chat/completions", 8)
            assert len(peers) == 8  # the second time they were reused
    finally:
        await runner.cleanup()
