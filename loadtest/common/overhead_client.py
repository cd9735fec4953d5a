"""The overhead benchmark's load generator (:mod:`loadtest.benchmarks.bench_overhead`): one aiohttp session,
SSE scanned by bytes (JSON only until the first content delta, so the client is not what is measured),
batches of streamed requests per leg, A/B interleaved rounds per concurrency level."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cluster.observability.server_timing import NAMES, parse_server_timing
from loadtest.common.overhead_stats import _r, percentile, summarize
from loadtest.common.procs import cpu_s, quiet_collector

HOST = "127.0.0.1"
# A leg's relay processes, looked up as each batch starts (a replica may be replaced between batches)
Relays = Mapping[str, Callable[[], Sequence[int]]]
MODEL = "bench-model"
HEADERS = {"content-type": "application/json", "x-surface": "chat"}
PROMPT = "Write a function that reverses a string, and explain it briefly."


@dataclass(frozen=True)
class Level:
    """One concurrency level of the relay phase: rounds x one batch per leg."""

    concurrency: int
    rounds: int
    batch: int  # requests per leg per round
    max_s: float  # a batch starts no request after this many seconds


# --- SSE by bytes (pure) ----------------------------------------------------------------------------


class SSEScan:
    """An incremental SSE reader over raw bytes: the first content delta, ``[DONE]``, usage, errors.

    Events are parsed as JSON only until the first content delta; after it, complete events are
    counted by their ``data:`` lines and searched, not decoded, except the one that carries the usage
    or an error (found by a byte search, then parsed alone).
    """

    __slots__ = ("_buf", "done", "error", "events", "first_content", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.events = 0
        self.first_content = False
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True when they complete the first event with content."""
        buf = self._buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return False
        block, self._buf = buf[: end + 2], buf[end + 2 :]
        hit, start = False, 0
        while not self.first_content and (stop := block.find(b"\n\n", start)) >= 0:
            hit = self._event(block[start:stop]) or hit
            start = stop + 2
        rest = block[start:]
        if rest:
            self.events += rest.count(b"\ndata:") + rest.startswith(b"data:")
            self.done = self.done or b"data: [DONE]" in rest or b"data:[DONE]" in rest
            for key in (b'"completion_tokens"', b'"error"'):
                if (i := rest.find(key)) >= 0:  # parse that one event
                    first = rest.rfind(b"\n\n", 0, i)
                    self._event(rest[0 if first < 0 else first + 2 : rest.find(b"\n\n", i)], count=False)
        return hit

    def _event(self, event: bytes, count: bool = True) -> bool:
        hit = False
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event: and id: lines
            payload = line[5:].strip()
            self.events += count
            if payload == b"[DONE]":
                self.done = True
            else:
                hit = self._parse(payload) or hit
        return hit

    def _parse(self, payload: bytes) -> bool:
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = "malformed event"
            return False
        if not isinstance(obj, dict):
            return False
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if self.first_content:
            return False
        for choice in obj.get("choices") or ():
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                self.first_content = True
                return True
        return False


# --- the client ------------------------------------------------------------------------------------


@dataclass
class Sample:
    ok: bool
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    completion_tokens: int | None = None
    error: str | None = None
    timing: dict[str, float] | None = None  # the gateway's Server-Timing (ms), where it sent one


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's CPU time over the batch: what the load generator costs
    relay_cpu_s: float | None = None  # the relay's processes' CPU time over the batch, where they are known


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


@contextlib.asynccontextmanager
async def client_session(keepalive_s: float = 15.0) -> AsyncIterator[aiohttp.ClientSession]:
    """The one client: keep-alive connections, no pool limit (concurrency bounds it), no cookies.
    ``keepalive_s``: how long an idle connection is kept (the relay benchmark's legs idle longer
    than aiohttp's 15 s between their batches, and hundreds of reconnects at once are not the relay)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=keepalive_s)
    timeout = aiohttp.ClientTimeout(total=120, sock_read=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=HEADERS, cookie_jar=aiohttp.DummyCookieJar()
    ) as session:
        yield session


async def stream_once(session: aiohttp.ClientSession, url: str, body: bytes) -> Sample:
    """One streamed request, timed from just before the send."""
    scan = SSEScan()
    ttft = None
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body) as resp:
            if resp.status != 200:
                return Sample(False, error=f"HTTP {resp.status}: {(await resp.text())[:160]}")
            timing_header = resp.headers.get("server-timing")  # parsed after the stream, not in its TTFT
            async for data in resp.content.iter_any():
                if scan.feed(data) and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000.0
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}"[:200])
    e2e = (time.perf_counter() - t0) * 1000.0
    error = scan.error or (None if scan.done else "no [DONE]") or (None if ttft is not None else "no content")
    tokens = (scan.usage or {}).get("completion_tokens")
    timing = parse_server_timing(timing_header) or None
    return Sample(error is None, ttft, e2e, tokens, error, timing)


async def run_jobs(
    session: aiohttp.ClientSession,
    url: str,
    jobs: Sequence[Sequence[bytes]],
    concurrency: int,
    max_s: float,
    relay: Callable[[], Sequence[int]] | None = None,
) -> Batch:
    """``concurrency`` workers take jobs (a job: bodies sent one after another, e.g. a conversation's
    turns) until none is left or ``max_s`` has passed. ``relay``: the relay's processes, whose CPU
    time over the batch is read from ``/proc``."""
    batch = Batch()
    pids = relay() if relay is not None else None
    relay0 = cpu_s(pids) if pids else 0.0
    pending = iter(jobs)
    deadline = time.perf_counter() + max_s

    async def worker() -> None:
        for job in pending:
            for body in job:
                if time.perf_counter() > deadline:
                    return
                batch.samples.append(await stream_once(session, url, body))

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    batch.wall_s = time.perf_counter() - t0
    batch.client_cpu_s = time.process_time() - cpu0
    if pids:
        batch.relay_cpu_s = cpu_s(pids) - relay0
    return batch


def leg_figures(batches: Sequence[Batch]) -> dict[str, Any]:
    samples = [s for b in batches for s in b.samples]
    ok = [s for s in samples if s.ok]
    wall = sum(b.wall_s for b in batches)
    errors = Counter(s.error for s in samples if not s.ok)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "errors": dict(errors.most_common(5)),
        "rps": _r(len(ok) / wall, 1) if wall > 0 else None,
        "client_cpu_ms_per_request": _r(1000 * sum(b.client_cpu_s for b in batches) / max(1, len(samples))),
        "relay_cpu_ms_per_request": _relay_cpu_ms(batches),
        "rps_by_round": [_r(sum(s.ok for s in b.samples) / b.wall_s, 1) for b in batches if b.wall_s > 0],
        "ttft_ms": summarize([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        "ttft_p50_ms_by_round": [_r(percentile([s.ttft_ms for s in b.samples if s.ok], 50)) for b in batches],
        "e2e_ms": summarize([s.e2e_ms for s in ok if s.e2e_ms is not None]),
        **split_figures(ok),
    }


def _relay_cpu_ms(batches: Sequence[Batch]) -> float | None:
    """The relay's CPU per request answered (ms), over batches that read it (None: none did)."""
    read = [b for b in batches if b.relay_cpu_s is not None]
    answered = sum(s.ok for b in read for s in b.samples)
    return _r(1000 * sum(b.relay_cpu_s or 0.0 for b in read) / answered) if answered else None


def split_figures(ok: Sequence[Sample]) -> dict[str, Any]:
    """Where a leg's TTFT went, from the gateway's Server-Timing (ours only; ms, per request then
    summarized): its four figures, ``gateway_own`` (its time to the first token less prep, queue and
    the upstream's), and ``outside`` (the client's TTFT less the gateway's: HAProxy, the HTTP server
    and Serve's replica wrapper, the loopback hops, the client)."""
    timed = [s for s in ok if s.timing and s.ttft_ms is not None and "ttft" in s.timing]
    if not timed:
        return {}
    split: dict[str, list[float]] = {n: [s.timing[n] for s in timed if n in s.timing] for n in NAMES}
    split["gateway_own"] = [
        s.timing["ttft"] - sum(s.timing.get(n, 0.0) for n in ("prep", "queue", "upstream")) for s in timed
    ]
    split["outside"] = [s.ttft_ms - s.timing["ttft"] for s in timed]
    return {"server_timing_ms": {name: summarize(v) for name, v in split.items()}}


async def ab_level(
    session: aiohttp.ClientSession, urls: dict[str, str], body: bytes, level: Level, relays: Relays
) -> dict[str, dict[str, Any]]:
    """Rounds of one batch per leg, the leg order rotating each round; each leg's figures over all
    (with its relay's CPU per request where ``relays`` names its processes)."""
    names = list(urls)
    got: dict[str, list[Batch]] = {n: [] for n in names}
    warmup = [[body]] * max(2 * level.concurrency, 16)
    for n in names:  # not recorded: connections opened, caches filled
        await run_jobs(session, urls[n], warmup, level.concurrency, 10.0)
    for r in range(level.rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            jobs = [[body]] * level.batch
            batch = await run_jobs(session, urls[n], jobs, level.concurrency, level.max_s, relays.get(n))
            got[n].append(batch)
    return {n: {"concurrency": level.concurrency, **leg_figures(b)} for n, b in got.items()}


async def measure_relay(
    urls: dict[str, str], body: bytes, levels: Sequence[Level], relays: Relays | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every level through one client session: ``legs[leg]["c16"]`` = that leg's figures;
    ``relays[leg]``: that leg's relay processes (their CPU is read over each of its batches)."""
    quiet_collector()  # no collector pause of ours inside the measurement
    legs: dict[str, dict[str, dict[str, Any]]] = {}
    async with client_session() as session:
        for level in levels:
            print(f"[relay] c{level.concurrency}: {level.rounds} rounds x {level.batch} requests per leg ...")
            for leg, fig in (await ab_level(session, urls, body, level, relays or {})).items():
                legs.setdefault(leg, {})[f"c{level.concurrency}"] = fig
    return legs


async def smoke(url: str, body: bytes) -> Sample:
    async with client_session() as session:
        return await stream_once(session, url, body)


def relay_body() -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()
