"""Issue 17's transport on real parts, without Ray: two simulated engine replicas serve their KV
events over loopback HTTP (the engine replica's endpoint), two gateway feeds follow them; both
gateways end with the same index and the same decision, a replica whose server goes away loses
its entries in both at once, and bad asks get a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from cluster.config import load_config
from cluster.engine.sim_backend import SimBackend
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.block_hash import BlockHasher
from cluster.routing.view import BackendView, ReplicaInfo
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER
from cluster.wire.protocol import GenerateRequest, Sampling
from deployments.engine.kv_endpoint import KVEventEndpoint
from deployments.gateway.kv_feed import KVEventFeed, kv_index_status

pytestmark = pytest.mark.integration
# The engines and feeds here are ours, in this process: they share a credential of their own (no
# Ray cluster's token needed, so the file runs alone as well as after the others).
TOKEN = "kv-feed-test-credential"


@dataclass
class Engine:
    name: str
    sim: SimBackend
    endpoint: KVEventEndpoint
    url: str
    runner: web.AppRunner


class Picker:
    """Serve's replica list, as ReplicaPicker.refresh hands it to the view."""

    def __init__(self, view: BackendView, engines: list[Engine]) -> None:
        self.view, self.engines = view, engines

    async def refresh(self) -> None:
        self.view.sync([ReplicaInfo(e.name, e.url, kv_events=True) for e in self.engines])


async def _engine(name: str) -> Engine:
    cfg = load_config("configs/sim-local.yaml")
    b = cfg.backends[0]
    sim = SimBackend.from_config(b, cfg.model(b.model), name)
    endpoint = KVEventEndpoint(sim.kv_events, TOKEN, BlockHasher(sim.engine.block_size, b.model))
    app = web.Application()
    app.router.add_get("/kv_events", endpoint.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return Engine(name, sim, endpoint, f"http://127.0.0.1:{port}", runner)


async def _until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_two_gateways_follow_the_same_events_and_drop_a_gone_replica() -> None:
    engines = [await _engine("A"), await _engine("B")]  # on the test's own loop, as its feeds
    session = aiohttp.ClientSession()
    views, feeds = [], []
    for _ in range(2):
        view = BackendView("sim", AffinityRouter(16, "sim-llama-8b", AffinityParams()), ReplicaEjector(), 64)
        feeds.append(KVEventFeed(view, Picker(view, engines), lambda: session, TOKEN))
        views.append(view)
    tasks = [asyncio.create_task(f.run()) for f in feeds]
    try:
        a = engines[0]
        prompt = list(range(7, 1207))
        req = GenerateRequest(
            "r1", "sim-llama-8b", "completion", prompt, Sampling(max_tokens=2), session_id="s1"
        )
        a.endpoint.announce(req)  # what the replica does as /generate receives it
        async for _ in a.sim.generate(req):
            pass
        hashes = views[0].policy.hash(prompt)
        full = len(hashes)
        await _until(lambda: all(v.policy.index.held_blocks("A") >= full for v in views))
        decisions = [v.choose(hashes, time.monotonic()) for v in views]
        assert [(d.replica, d.decision.reason, d.decision.matched_blocks) for d in decisions] == [
            ("A", "prefix", full)
        ] * 2
        assert all(v.policy.sessions.get("s1", time.monotonic()) == "A" for v in views)

        await a.runner.cleanup()  # A's server is gone (its process died): Serve still lists it
        await _until(lambda: all(f.lost for f in feeds))
        for v, f in zip(views, feeds, strict=True):
            assert kv_index_status(v, f)["replicas"]["A"]["blocks"] == 0
            assert v.choose(hashes, time.monotonic()).decision.reason == "new_prefix"

        b = engines[1]
        async with session.get(
            b.url + "/kv_events", params={"after": "x"}, headers={INTERNAL_TOKEN_HEADER: TOKEN}
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "after"
        async with session.get(b.url + "/kv_events") as r:
            assert r.status == 403
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        for e in engines:
            await e.sim.close()
            with contextlib.suppress(RuntimeError):  # A's was stopped above
                await e.runner.cleanup()


async def test_a_busy_engine_is_polled_at_most_every_min_poll_s() -> None:
    """An engine with new events at every step answers each long poll at once; the feed must still
    ask it at most every MIN_POLL_S (asking at every step cost a gateway 14 % of its CPU)."""
    from deployments.gateway import kv_feed

    engine = await _engine("A")
    gets = 0

    async def counted(request: web.Request) -> web.StreamResponse:
        nonlocal gets
        gets += 1
        return await engine.endpoint.handle(request)

    app = web.Application()
    app.router.add_get("/kv_events", counted)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    session = aiohttp.ClientSession()
    view = BackendView("sim", AffinityRouter(16, "sim-llama-8b", AffinityParams()), ReplicaEjector(), 64)
    feed = KVEventFeed(
        view, Picker(view, [Engine("A", engine.sim, engine.endpoint, url, runner)]), lambda: session, TOKEN
    )
    stop = asyncio.Event()

    async def busy() -> None:  # one request after another: events at (nearly) every engine step
        i = 0
        while not stop.is_set():
            i += 1
            req = GenerateRequest(
                f"r{i}", "sim-llama-8b", "completion", list(range(i, i + 300)), Sampling(max_tokens=4)
            )
            engine.endpoint.announce(req)
            async for _ in engine.sim.generate(req):
                pass

    feeding = asyncio.create_task(feed.run())
    load = asyncio.create_task(busy())
    try:
        await _until(lambda: feed.cursors.get("A") is not None and feed.cursors["A"].batches > 0)
        gets_before, batches_before, t0 = gets, feed.cursors["A"].batches, time.monotonic()
        await asyncio.sleep(1.5)
        polls, elapsed = gets - gets_before, time.monotonic() - t0
        batches = feed.cursors["A"].batches - batches_before
    finally:
        stop.set()
        feeding.cancel()
        await asyncio.gather(feeding, load, return_exceptions=True)
        await session.close()
        await engine.sim.close()
        await runner.cleanup()
        await engine.runner.cleanup()
    # Pages coalesce the engine's batches (a poll per step would make them equal), and the polls
    # keep to the bound.
    assert batches > 2 * polls, (batches, polls)
    assert kv_feed.MIN_POLL_S >= 0.05  # a bound of a few ms would be the per-step polling again
    assert 3 <= polls <= elapsed / kv_feed.MIN_POLL_S + 2, (polls, elapsed)


async def test_pushed_pages_reach_every_gateway_and_a_missed_one_is_asked_for() -> None:
    """Issue 42's transport: engines push each page once on a ZMQ socket; two gateways' feeds apply
    them (asking each log only to start), ask a log again when a page was lost on the way, drop a
    replica's entries when its process dies, and a subscriber without the credential hears nothing."""
    from deployments.engine.kv_pub import KVEventPublisher
    from deployments.gateway.kv_sub import KVSubscriber

    engines = [await _engine("A"), await _engine("B")]
    pubs = [KVEventPublisher(e.endpoint, e.name, "127.0.0.1", TOKEN, heartbeat_s=0.2) for e in engines]

    class Pushing(Picker):
        async def refresh(self) -> None:
            self.view.sync(
                [
                    ReplicaInfo(e.name, e.url, kv_events=True, kv_pub=p.address)
                    for e, p in zip(self.engines, pubs, strict=True)
                ]
            )

    session = aiohttp.ClientSession()
    views, feeds = [], []
    for _ in range(2):
        view = BackendView("sim", AffinityRouter(16, "sim-llama-8b", AffinityParams()), ReplicaEjector(), 64)
        feeds.append(KVEventFeed(view, Pushing(view, engines), lambda: session, TOKEN))
        views.append(view)
    tasks = [asyncio.create_task(f.run()) for f in feeds]
    stranger = KVSubscriber("not-the-credential")
    heard: list[bytes] = []
    stranger.follow("A", pubs[0].address, heard.append, lambda: None)
    listening = asyncio.create_task(stranger.run())
    a = engines[0]

    async def serve(i: int, first: int) -> list[int]:
        prompt = list(range(first, first + 1200))
        req = GenerateRequest(f"r{i}", "sim-llama-8b", "completion", prompt, Sampling(max_tokens=2))
        a.endpoint.announce(req)
        async for _ in a.sim.generate(req):
            pass
        return views[0].policy.hash(prompt)

    def held(n: int) -> bool:
        return all(v.policy.index.held_blocks("A") >= n for v in views)

    try:
        await _until(lambda: all(set(f.pushed) == {"A", "B"} and f.asks >= 2 for f in feeds))
        first = await serve(1, 7)
        await _until(lambda: held(len(first)))
        assert held(len(first)) and all(f.sub is not None and f.sub.messages > 0 for f in feeds)
        assert all(f.asks == 2 for f in feeds), [f.asks for f in feeds]  # one ask per replica: to start

        send = pubs[0]._send
        pubs[0]._send = lambda body: None  # type: ignore[method-assign]  # this page is lost on the way
        second = await serve(2, 5000)
        await asyncio.sleep(0.05)
        pubs[0]._send = send  # type: ignore[method-assign]
        await _until(lambda: held(len(first) + len(second)))  # the next heartbeat shows the gap
        assert held(len(first) + len(second)) and all(f.asks > 2 for f in feeds)
        assert views[0].choose(second, time.monotonic()).decision.reason == "prefix"
        assert heard == [] and stranger.messages == 0  # no handshake without the credential

        pubs[0].close()  # A's process died: its publisher's socket and its server went with it
        await a.runner.cleanup()
        await _until(
            lambda: all(f.lost for f in feeds) and all(v.policy.index.held_blocks("A") == 0 for v in views)
        )
        assert all(f.lost for f in feeds) and all(v.policy.index.held_blocks("A") == 0 for v in views)
    finally:
        for t in [*tasks, listening]:
            t.cancel()
        await asyncio.gather(*tasks, listening, return_exceptions=True)
        await session.close()
        for p in pubs[1:]:
            p.close()
        for e in engines:
            await e.sim.close()
            with contextlib.suppress(RuntimeError):
                await e.runner.cleanup()
