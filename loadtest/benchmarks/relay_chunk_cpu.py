"""Our provider token path's CPU per relayed chunk in one process, against a bare relay loop (issue 44).

    python -m loadtest.benchmarks.relay_chunk_cpu [--streams 64] [--chunks 200] [--interval-ms 5]
        [--rounds 5]

A paced fake OpenAI upstream (:mod:`loadtest.common.fake_upstream`) runs in its own process; this
process streams ``--streams`` answers at once from it, ``--rounds`` times per leg, legs interleaved,
and prints the process's CPU (``time.process_time``) per chunk, min and median over the rounds:

* **bare**: aiohttp's ``iter_any`` into an ASGI-shaped ``send`` that writes nothing (the floor
  leg's relay, ``loadtest/common/serve_floor.py``, minus Serve, uvicorn and the socket);
* **ours**: the gateway's provider path as the relay runs it: the OpenAI adapter's stream
  (``ProviderBackend.generate_framed``), the client's events framed on the way
  (``ChunkFramer``), the race's ``follow`` watchdog, and the relay's loop into the same ``send``.

What neither leg has (HAProxy, Serve's and uvicorn's send chain, the write itself, the request's
preparation, admission and accounting) is what ``bench_relay.py`` measures end to end; this one
isolates the per-chunk Python that our code adds, for A/B of a change to it in seconds. A
diagnosis tool: it records no benchmark figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.policy.failover import PlannedAttempt
from cluster.policy.race import Attempt, RaceHooks, follow
from cluster.wire.framing import ChunkFramer, FramedStream
from cluster.wire.openai_format import ResponseMeta
from cluster.wire.protocol import GenerateRequest, Sampling
from deployments.launcher.local import free_port
from deployments.providers.provider_http import aclose_shared_session
from deployments.providers.providers import ProviderBackend, build_provider_backend
from loadtest.common.overhead_client import HOST, MODEL
from loadtest.common.overhead_cluster import provider_config
from loadtest.common.procs import Proc, wait_http

Message = dict[str, Any]


async def _send(message: Message) -> None:
    """An ASGI ``send`` minus the socket."""


def _body(chunks: int) -> bytes:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": chunks}
    return orjson.dumps(req | {"stream": True, "stream_options": {"include_usage": True}})


async def bare_one(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    """One answer through the bare loop: the reads it relayed."""
    reads = 0
    headers = {"content-type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        await _send({"type": "http.response.start", "status": resp.status, "headers": []})
        async for data in resp.content.iter_any():
            await _send({"type": "http.response.body", "body": data, "more_body": True})
            reads += 1
    await _send({"type": "http.response.body", "body": b"", "more_body": False})
    return reads


def _request(i: int, chunks: int) -> GenerateRequest:
    rid = f"relay-cpu-{i}-{time.time_ns()}"
    return GenerateRequest(
        request_id=rid,
        model=MODEL,
        kind="chat",
        prompt_token_ids=[1, 2, 3],
        sampling=Sampling(max_tokens=chunks),
        messages=[{"role": "user", "content": "hi"}],
        options={"stream_options": {"include_usage": True}},
    )


async def ours_one(backend: ProviderBackend, i: int, chunks: int) -> int:
    """One answer through our provider path, as the gateway's relay loop runs it."""
    req = _request(i, chunks)
    framer = ChunkFramer(ResponseMeta("chat", req.request_id, MODEL))
    stream = FramedStream(backend.generate_framed(req, framer.frame), framer)
    data: bytes | None = await anext(stream)
    hooks = RaceHooks(next_attempt=lambda _: None, start=lambda *_: None, cancel=lambda s: s.aclose())
    winner = Attempt(PlannedAttempt(backend.backend_name, 0), False, stream, time.monotonic())
    rest = follow(hooks, winner, None, 30.0)
    await _send({"type": "http.response.start", "status": 200, "headers": []})
    reads = 0
    while data is not None:
        if data:
            await _send({"type": "http.response.body", "body": data, "more_body": True})
        reads += 1
        data = await anext(rest, None)
    await _send({"type": "http.response.body", "body": b"", "more_body": False})
    return reads


async def _rounds(one: Callable[[int], Awaitable[int]], streams: int, rounds: int) -> list[float]:
    """CPU seconds of each round of ``streams`` answers at once (a first round warms, uncounted)."""
    await asyncio.gather(*(one(i) for i in range(streams)))
    out = []
    for _ in range(rounds):
        c0 = time.process_time()
        await asyncio.gather(*(one(i) for i in range(streams)))
        out.append(time.process_time() - c0)
    return out


async def measure(up_port: int, args: argparse.Namespace) -> dict[str, list[float]]:
    cfg = provider_config(up_port, free_port())
    model = cfg.model(cfg.backends[0].model)
    assert model is not None
    backend = build_provider_backend(cfg.backends[0], model, "relay-cpu-0")
    url, body = f"http://{HOST}:{up_port}/v1/chat/completions", _body(args.chunks)
    cpu: dict[str, list[float]] = {"bare": [], "ours": []}
    async with aiohttp.ClientSession() as session:
        legs: dict[str, Callable[[int], Awaitable[int]]] = {
            "bare": lambda _: bare_one(session, url, body),
            "ours": lambda i: ours_one(backend, i, args.chunks),
        }
        for _ in range(args.rounds):  # legs interleaved, a round each at a time
            for name, one in legs.items():
                cpu[name] += await _rounds(one, args.streams, 1)
    await aclose_shared_session()  # the adapter's pooled session
    return cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    up_port = free_port()
    cmd = [sys.executable, "-m", "loadtest.common.fake_upstream", "--port", str(up_port)]
    cmd += ["--chunks", str(args.chunks), "--interval-ms", str(args.interval_ms)]
    with Proc("fake-upstream", cmd, Path(tempfile.mkdtemp(prefix="llmc-relay-cpu-"))) as up:
        wait_http(f"http://{HOST}:{up_port}/health", up, 30)
        cpu = asyncio.run(measure(up_port, args))
    per = args.streams * args.chunks / 1e6  # chunks per round, in millions: seconds -> us per chunk
    med = {name: statistics.median(rounds) / per for name, rounds in cpu.items()}
    for name, rounds in cpu.items():
        print(f"{name}: CPU per chunk min {min(rounds) / per:.2f} us, median {med[name]:.2f} us")
    print(f"ours over bare (medians): {med['ours'] - med['bare']:+.2f} us per chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
