"""The engine's KV-event feed cut (issue 41's ``kv_feed_cut`` rehearsal event), on real parts
without Ray: a simulated engine's event endpoint over loopback HTTP. ``POST /kv_events/fault``
asks the internal credential; while a cut lasts a poll gets no answer (the poller times out, as
behind a dropped route) and the engine still serves; once it ends, polls answer again from where
the poller was, the events of the cut included."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from cluster.config import load_config
from cluster.engine.sim_backend import SimBackend
from cluster.routing.block_hash import BlockHasher
from cluster.wire.engine_stream import INTERNAL_TOKEN_HEADER
from cluster.wire.protocol import GenerateRequest, Sampling
from deployments.engine.kv_endpoint import KVEventEndpoint

pytestmark = pytest.mark.integration
TOKEN = "kv-feed-cut-test-credential"
AUTH = {INTERNAL_TOKEN_HEADER: TOKEN}


async def _serve_one(sim: SimBackend, endpoint: KVEventEndpoint, i: int) -> None:
    req = GenerateRequest(
        f"r{i}", "sim-llama-8b", "completion", list(range(i, i + 64)), Sampling(max_tokens=2)
    )
    endpoint.announce(req)
    async for _ in sim.generate(req):
        pass


async def test_a_cut_feed_stalls_polls_while_the_engine_serves() -> None:
    cfg = load_config("configs/sim-local.yaml")
    b = cfg.backends[0]
    sim = SimBackend.from_config(b, cfg.model(b.model), "A")
    endpoint = KVEventEndpoint(sim.kv_events, TOKEN, BlockHasher(sim.engine.block_size, b.model))
    app = web.Application()
    app.router.add_get("/kv_events", endpoint.handle)
    app.router.add_post("/kv_events/fault", endpoint.fault)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/kv_events"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/fault", json={"cut_s": 5}) as r:
                assert r.status == 403  # no credential, no fault
            async with s.post(url + "/fault", json={"cut_s": -1}, headers=AUTH) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "cut_s"
            await _serve_one(sim, endpoint, 1)
            async with s.get(url, params={"after": "0"}, headers=AUTH) as r:
                before = (await r.json())["last_seq"]
            async with s.post(url + "/fault", json={"cut_s": 30}, headers=AUTH) as r:
                assert r.status == 200 and (await r.json())["last_seq"] == before
            await _serve_one(sim, endpoint, 2)  # the engine serves through the cut
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=0.5)
                async with s.get(url, params={"after": str(before)}, headers=AUTH, timeout=timeout) as r:
                    await r.read()
            assert time.monotonic() - t0 >= 0.45  # unanswered until the poller gave up
            async with s.post(url + "/fault", json={"cut_s": 0}, headers=AUTH) as r:
                head = (await r.json())["last_seq"]
            assert head > before  # the cut's events were logged all the same
            async with s.get(url, params={"after": str(before)}, headers=AUTH) as r:
                page = await r.json()
            assert r.status == 200 and page["last_seq"] == head and page["batches"]
    finally:
        await sim.close()
        await runner.cleanup()
