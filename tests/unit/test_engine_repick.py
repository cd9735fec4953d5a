"""An engine attempt that meets a replica which cannot run it (its port refuses the connection, or
its engine is dead) picks another replica within the same attempt: the request never reached an
engine there. Real HTTP on loopback (aiohttp servers standing in for engine replicas' token
endpoints); the choice sequence is a plain function."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
from aiohttp import web

from cluster.routing.affinity import RouteDecision
from cluster.routing.view import Choice
from cluster.wire.engine_stream import end_frame
from cluster.wire.errors import ENGINE_DEAD_CODE, BackendUnavailable, InvalidRequest, to_wire
from cluster.wire.protocol import Usage
from deployments.gateway.engine_client import EngineStream, ReplicaLease

EVENT = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once closed


async def _serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _dead(request: web.Request) -> web.Response:
    err = BackendUnavailable("vLLM replica r failed: EngineCore died", code=ENGINE_DEAD_CODE)
    return web.json_response({"error": to_wire(err)}, status=502)


async def _refuses_the_request(request: web.Request) -> web.Response:
    return web.json_response({"error": to_wire(InvalidRequest("bad schema"))}, status=400)


async def _streams(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(EVENT)
    await resp.write(end_frame("stop", Usage(3, 1), replica="ok"))
    return resp


class _View:
    """What a lease tells the routing view (a BackendView's counting methods, recorded)."""

    def __init__(self, skipped: list[str]) -> None:
        self.skipped, self.ends = skipped, 0

    def prefilled(self, choice: Choice) -> None:
        pass

    def ended(self, replica: str, choice: Choice | None = None) -> None:
        self.ends += 1

    def mark_unreachable(self, replica: str, now: float) -> None:
        self.skipped.append(f"http://127.0.0.1:{replica}")


def _choices(*urls: str) -> Any:
    it = iter(urls)

    async def choose(view: Any) -> ReplicaLease:
        url = next(it)
        return ReplicaLease(view, Choice(url.rsplit(":", 1)[-1], url, RouteDecision(None, "load", 0, 0, 0)))

    return choose


async def _run(choose: Any, skipped: list[str]) -> list[bytes]:
    body = {"req": {}, "meta": {}, "collect": False}
    view = _View(skipped)
    async with aiohttp.ClientSession() as session:
        stream = EngineStream(session, "t", body, "b", lambda: choose(view))
        try:
            return [chunk async for chunk in stream]
        finally:
            await stream.aclose()


def test_a_refused_connection_and_a_dead_engine_are_skipped_for_a_replica_that_streams() -> None:
    async def main() -> None:
        dead, dead_url = await _serve(_dead)
        ok, ok_url = await _serve(_streams)
        refused_url = f"http://127.0.0.1:{_closed_port()}"
        try:
            skipped: list[str] = []
            out = await _run(_choices(refused_url, dead_url, ok_url), skipped)
            assert b"".join(out) == EVENT
            assert skipped == [refused_url, dead_url]  # the view skips both for a while
        finally:
            await dead.cleanup()
            await ok.cleanup()

    asyncio.run(main())


def test_any_other_refusal_is_the_attempts_answer_and_nothing_is_skipped() -> None:
    async def main() -> None:
        bad, bad_url = await _serve(_refuses_the_request)
        try:
            skipped: list[str] = []
            try:
                await _run(_choices(bad_url), skipped)
            except InvalidRequest as err:
                assert "bad schema" in str(err)
            else:
                raise AssertionError("the engine's 400 did not reach the attempt")
            assert skipped == []
        finally:
            await bad.cleanup()

    asyncio.run(main())


def test_a_lease_alone_changes_the_views_counts_and_ends_once() -> None:
    from cluster.policy.failover import ReplicaEjector
    from cluster.routing.affinity import AffinityParams, AffinityRouter
    from cluster.routing.view import BackendView, ReplicaInfo

    view = BackendView("b", AffinityRouter(4, "m", AffinityParams()), ReplicaEjector(), 64)
    view.sync([ReplicaInfo("r0", "http://r0")])
    hashes = [1, 2, 3]
    choice = view.choose(hashes, 0.0, None)
    assert choice is not None
    view.started(choice, hashes, 0.0, None, 40)  # what ReplicaPicker.pick does before leasing
    with ReplicaLease(view, choice) as lease:
        s = view.snapshot()
        assert s.in_flight["r0"] == 1 and s.prefilling.get("r0", 0) > 0
        lease.first_token()
        s = view.snapshot()
        assert s.prefilling.get("r0", 0) == 0 and s.in_flight["r0"] == 1
        lease.close()
        other = view.choose(hashes, 1.0, None)
        assert other is not None
        view.started(other, hashes, 1.0, None)  # another attempt there meanwhile
    assert view.snapshot().in_flight.get("r0", 0) == 1  # the lease ended once: the other's count stands
    ReplicaLease(view, other).unreachable(1.0)
    after = view.snapshot()
    assert after.in_flight.get("r0", 0) == 0 and view.choose(hashes, 1.5, None) is None  # skipped a while
