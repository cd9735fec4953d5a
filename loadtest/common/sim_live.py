"""The live half of the simulated-replica benchmarks (:mod:`loadtest.benchmarks.bench_affinity`,
:mod:`loadtest.benchmarks.bench_overload`, :mod:`loadtest.benchmarks.bench_overload_shared`): streamed chat
requests replayed at their arrival times through a real Serve app, what the client saw of each, and the
figures' units. Read with the project's SSE decoder (:class:`loadtest.common.client.EventStream`)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.common.client import EventStream
from loadtest.common.procs import quiet_collector
from loadtest.common.request_spec import RequestSpec
from loadtest.common.stats import nearest_rank

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtest" / "results"
MODEL = "sim-llama-8b"
PROFILE = "llama-3.1-8b-h100"
percentile = nearest_rank  # the name these benchmarks' code uses


@dataclass
class Result:
    """What the client saw of one request (times in seconds from the replay's start)."""

    index: int
    session_id: str
    surface: str | None
    sent_s: float = 0.0
    status: int = 0  # HTTP status; 0 when no response came
    ttft_s: float | None = None  # send -> first content chunk
    latency_s: float | None = None  # send -> end of the response
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    retry_after: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    hung: bool = False  # the client's deadline ended it, not the server
    timing: str | None = None  # the gateway's Server-Timing header, as sent (parse_server_timing)


def _request(spec: RequestSpec, model: str, session_header: bool) -> tuple[dict[str, Any], dict[str, str]]:
    body = {
        "model": model,
        "messages": [dict(m) for m in spec.messages or ()],
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {}
    if session_header:
        headers["x-session-id"] = spec.session_id
    if spec.surface:
        headers["x-surface"] = spec.surface
    if spec.tenant:
        headers["x-tenant"] = spec.tenant
    return body, headers


def _event(res: Result, obj: dict[str, Any], since_send: float) -> None:
    """One ``data`` object of the stream into ``res``."""
    if "error" in obj:
        res.error = json.dumps(obj["error"])[:300]
        return
    for choice in obj.get("choices") or ():
        if choice.get("delta", {}).get("content"):
            if res.ttft_s is None:
                res.ttft_s = since_send
            res.output_tokens += 1  # one chunk per token (fallback if no usage)
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if usage:
        res.output_tokens = usage.get("completion_tokens", res.output_tokens)
        res.prompt_tokens = usage.get("prompt_tokens", 0)
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def session(timeout_s: float, max_connections: int = 2000) -> aiohttp.ClientSession:
    """The live client: aiohttp, no total timeout (``stream_chat`` bounds each request), a pool as
    large as the benchmarks' concurrency. Not httpx: with 32 streams open in the same process,
    httpx's own pool took 2.5 ms (p50) and 8.8 ms (p99) to hand back a 429 that aiohttp read in
    0.27 / 1.1 ms (loopback, 2026-12-03): the load generator's cost, counted as the cluster's."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s),
        connector=aiohttp.TCPConnector(limit=max_connections),
    )


async def stream_chat(
    client: aiohttp.ClientSession,
    url: str,
    spec: RequestSpec,
    res: Result,
    t0: float,
    *,
    timeout_s: float,
    model: str = MODEL,
    session_header: bool = True,
) -> None:
    body, headers = _request(spec, model, session_header)
    clock = time.perf_counter
    start = clock()
    res.sent_s = start - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.post(url, json=body, headers=headers) as resp:
                res.status = resp.status
                res.replica = resp.headers.get("x-llmc-replica", "")
                res.retry_after = resp.headers.get("retry-after")
                res.timing = resp.headers.get("server-timing")  # parsed after, outside the stream
                if resp.status != 200:
                    res.error = (await resp.read()).decode(errors="replace")[:300]
                    return
                async for data in EventStream().aiter(resp):
                    _event(res, json.loads(data), clock() - start)
    except TimeoutError:
        res.hung = True
        res.error = f"no end within {timeout_s} s"
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.latency_s = clock() - start


async def replay(
    url: str,
    specs: Sequence[RequestSpec],
    *,
    timeout_s: float,
    closed_loop: bool = True,
    session_header: bool = True,
    model: str = MODEL,
    lag: list[float] | None = None,
    warm_connections: int = 0,
) -> tuple[list[Result], float]:
    """Send every spec at its arrival time (a session's next turn waits for its previous one when
    ``closed_loop``); returns the results in spec order and the wall time of the whole replay.
    ``lag``: filled with the client's own event-loop lag (seconds, sampled every 10 ms), the part
    of every client-side time that is the load generator's, not the cluster's.
    ``warm_connections``: open that many keep-alive connections (concurrent ``GET /v1/models``)
    before the clock starts, so that the first requests do not also pay their TCP connections,
    as a client that keeps its connection does not."""
    quiet_collector()  # no collector pause of ours inside the measurement
    results = [Result(i, s.session_id, s.surface) for i, s in enumerate(specs)]
    done = [asyncio.Event() for _ in specs]
    prev: list[int | None] = []
    last: dict[str, int] = {}
    for i, s in enumerate(specs):
        prev.append(last.get(s.session_id))
        last[s.session_id] = i
    async with session(timeout_s) as client:
        if warm_connections:
            await open_connections(client, url, warm_connections)
        t0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            try:
                await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
                p = prev[i]
                if closed_loop and p is not None:
                    await done[p].wait()
                await stream_chat(
                    client,
                    url,
                    spec,
                    results[i],
                    t0,
                    timeout_s=timeout_s,
                    session_header=session_header,
                    model=model,
                )
            finally:
                done[i].set()

        probe = asyncio.create_task(loop_lag(lag)) if lag is not None else None
        try:
            await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        finally:
            if probe is not None:
                probe.cancel()
        wall = time.perf_counter() - t0
    return results, wall


async def open_connections(client: aiohttp.ClientSession, url: str, n: int) -> None:
    """``n`` keep-alive connections in ``client``'s pool: ``n`` concurrent GETs of the models list
    beside ``url`` (each needs its own connection while the others are in flight)."""
    models = url.split("/v1/", 1)[0] + "/v1/models"

    async def one() -> None:
        async with client.get(models) as resp:
            await resp.read()

    await asyncio.gather(*(one() for _ in range(n)))


async def loop_lag(out: list[float], every_s: float = 0.01) -> None:
    """Append how late each ``every_s`` sleep of this event loop wakes, until cancelled."""
    clock = time.perf_counter
    while True:
        t = clock()
        await asyncio.sleep(every_s)
        out.append(max(0.0, clock() - t - every_s))


def ms(x: float | None, scale: float = 1.0) -> float | None:
    return None if x is None else round(x * 1000 * scale, 1)


async def warm_up(url: str, n: int, model: str = MODEL) -> None:
    """A few short requests (no full KV block, so no routing state): Serve's first-request costs."""
    spec = RequestSpec(session_id="warmup", messages=[{"role": "user", "content": "warm up"}], max_tokens=2)
    async with session(60) as client:
        rs = [Result(i, "warmup", None) for i in range(n)]
        await asyncio.gather(
            *(
                stream_chat(client, url, spec, r, 0.0, timeout_s=60, session_header=False, model=model)
                for r in rs
            )
        )
    bad = [r for r in rs if r.status != 200]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0].status} {bad[0].error}")


def machine() -> dict[str, Any]:
    import ray

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "ray": ray.__version__,
        "git_commit": commit,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "note": "a shared machine: other work ran alongside; its load average is recorded per run",
    }
