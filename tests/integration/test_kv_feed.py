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
from deployments.kv_endpoint import KVEventEndpoint
from deployments.kv_feed import KVEventFeed, kv_index_status

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
