"""The KV-event control plane at fleet scale (issue 42): N engines' events into M gateways' indexes.

A simulation, since a fleet does not fit on 2 cores. A script, not a test:
``python -m loadtest.benchmarks.bench_control_plane [--quick]`` writes
``loadtest/results/control_plane.json``.

Engines (``EngineSource``): what one replica of a GPU profile (``cluster/engine/profiles.py``,
default ``llama-3.1-8b-h100``) publishes at a stated utilisation: one ``KVEventBatch`` per engine
step; ``BlockStored`` for the blocks its prefill and decode compute (runs of blocks chained to a
parent, 16 token ids a block, vLLM's 64-bit engine hashes), as many ``BlockRemoved`` once its cache
is full (KV pressure: a steady state stores as much as it evicts), and a ``BlocksQueued`` for each
arriving request (its whole prompt's router hashes: agent contexts that recur, prefix reuse). The
engine replica's server (``KVEventEndpoint``) turns them into what it publishes: the router's
hashes of the anchors alone (``affinity.claim_stride_blocks``, ``cluster/routing/event_hashes.py``).

Transport: in-process, on a virtual clock. Each engine appends to a real ``KVEventLog``; each of
the M gateways asks each engine for its page every ``MIN_POLL_S`` as ``deployments/gateway/kv_feed.py``
does (under load an engine has new events at every step, so the long poll answers at once): the
engine side runs ``KVEventLog.since`` + ``page_to_wire`` + ``json.dumps`` (what
``kv_endpoint``'s ``web.json_response`` does), the gateway side ``page_from_json``
+ ``BackendView.apply_kv_page`` + ``FeedCursor.advance`` (what ``kv_feed`` does after
``resp.read()``) on the gateway's own ``BackendView``/``AffinityRouter`` (the classes and config
defaults the gateway builds). Both sides' CPU is ``time.thread_time`` of that work (less the
collector's pauses within it: ``work_time``), divided by the
virtual seconds simulated: CPU seconds per wall second at the real rates. A gateway is one event
loop: a single-server queue whose service times are the measured CPU times, which gives the event
-> index lag (event's step end -> its page applied). The HTTP layer itself (aiohttp's request
handling on both sides) is measured apart, on loopback with the real ``KVEventEndpoint`` and
``KVEventFeed`` (``--http``), and added per poll.

Index memory (a ``sys.getsizeof`` walk of the router's structures) and the routing decision
(``BackendView.choose`` with N live replicas) are measured at the steady-state size, the index
filled directly to what full caches hold (``min(index_capacity_blocks, N x KV blocks)``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import heapq
import inspect
import json
import math
import os
import random
import sys
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.config import AffinityConfig
from cluster.engine import kv_events
from cluster.engine.kv_events import (
    BlockRemoved,
    BlocksQueued,
    BlockStored,
    FeedCursor,
    KVEventBatch,
    KVEventLog,
    KVEventPage,
    page_from_wire,
    page_to_wire,
)
from cluster.engine.profiles import BatchShape, Profile, get_profile
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.block_hash import BlockHasher
from cluster.routing.index_mirror import FrameBuilder, decode_frame, encode_frame
from cluster.routing.view import BackendView, ReplicaInfo
from deployments.engine.kv_endpoint import KVEventEndpoint
from deployments.gateway.kv_feed import MIN_POLL_S
from loadtest.common.provenance import git_state, provenance, write_report

RESULTS = Path(__file__).resolve().parents[1] / "results"
TOKEN = "bench-token"
BLOCK = 16
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


# -- the clock of the simulated work --------------------------------------------------------------


class _Collector:
    """The garbage collector's pauses in this thread, summed (``gc.callbacks``). This one process
    holds every simulated engine, indexer and gateway, a heap no real process has: a full
    collection of it, landing in whichever gateway's work triggered it, is the simulation's cost,
    not that gateway's. ``work_time`` leaves it out; each row reports it apart (``sim_gc_s``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started


COLLECTOR = _Collector()


def work_time() -> float:
    """This thread's CPU seconds less the collector's pauses so far (see :class:`_Collector`)."""
    return time.thread_time() - COLLECTOR.seconds


# -- what one engine publishes -------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """One engine's event rates, from its profile at a utilisation (see ``engine_rates``)."""

    step_s: float
    computed_tokens_per_s: float
    stored_blocks_per_s: float
    requests_per_s: float
    prompt_blocks: int
    reuse: float

    def scaled(self, k: float) -> Rates:
        """The same engine at ``k`` times the rates (same steps, fewer tokens and requests)."""
        return dataclasses.replace(
            self,
            computed_tokens_per_s=self.computed_tokens_per_s * k,
            stored_blocks_per_s=self.stored_blocks_per_s * k,
            requests_per_s=self.requests_per_s * k,
        )

    def as_dict(self) -> dict[str, float]:
        return {k: round(float(v), 4) for k, v in self.__dict__.items()}


def engine_rates(
    profile: Profile, utilisation: float, prompt_tokens: int, reuse: float, decode_seqs: int
) -> Rates:
    """A step that fills ``utilisation`` of the token budget with prefill of ``prompt_tokens``
    prompts (``reuse`` of each cached: only the rest is computed and stored) next to
    ``decode_seqs`` decoding sequences; rates are per second of such steps."""
    e = profile.engine
    chunk = int(e.max_num_batched_tokens * utilisation)
    ctx = prompt_tokens // 2  # a chunk's average context so far
    shape = BatchShape(
        prefill_tokens=chunk,
        decode_tokens=decode_seqs,
        kv_read_tokens=chunk + ctx + decode_seqs * prompt_tokens,
        attn_pairs=chunk * (ctx + chunk // 2) + decode_seqs * prompt_tokens,
    )
    step_s = profile.step_time_model().step_time(shape)
    computed = (chunk + decode_seqs) / step_s
    requests = chunk / step_s / (prompt_tokens * (1 - reuse))
    return Rates(step_s, computed, computed / BLOCK, requests, prompt_tokens // BLOCK, reuse)


class EngineSource:
    """One engine replica's KV events on the virtual clock, into its own ``KVEventLog``."""

    def __init__(self, i: int, rates: Rates, cache_blocks: int, contexts: int, seed: int) -> None:
        self.name = f"engine-{i}"
        self.log = KVEventLog(max_batches=8192, epoch=i + 1)
        # the replica's server: whatever it makes of the log (today, the router's hashes of the
        # anchors the gateways look up: every claim_stride_blocks-th block of a chain and its last)
        self.endpoint = KVEventEndpoint(self.log, TOKEN, BlockHasher(BLOCK, MODEL), *_stride())
        self.rng = random.Random(seed)
        self.rates = rates
        self.cache_blocks = cache_blocks
        self._next = (i + 1) << 40  # the engine's own block hashes: unique per engine
        self._held: deque[int] = deque()
        self._parent: int | None = None
        self._debt = 0.0
        self._arrivals = 0.0
        rng = self.rng  # the agent contexts that recur on this engine: their router hashes
        self.contexts = [[rng.getrandbits(63) for _ in range(rates.prompt_blocks)] for _ in range(contexts)]
        self.tokens = [rng.randrange(128_000) for _ in range(BLOCK * 64)]
        self.keep = int(rates.prompt_blocks * rates.reuse)  # a request's blocks its context holds

    def warm(self, view: BackendView) -> None:
        """A gateway that has seen each of this engine's contexts once (the steady state the
        simulated seconds are too short to reach): one page announcing them, applied untimed."""
        queued = tuple(BlocksQueued(c[: self.keep], f"s{i}") for i, c in enumerate(self.contexts))
        view.apply_kv_page(self.name, KVEventPage(0, [KVEventBatch(1, 0.0, queued)], 0, True), 0.0)

    def warm_router(self, builder: FrameBuilder) -> None:
        """``warm`` for the indexer design: the indexer's router sees each context once."""
        queued = tuple(BlocksQueued(c[: self.keep], f"s{i}") for i, c in enumerate(self.contexts))
        builder.take(self.name, KVEventPage(0, [KVEventBatch(1, 0.0, queued)], 0, True), 0.0)

    def step(self, now: float) -> float:
        """One engine step ending at ``now``: its events appended to the log. Returns the CPU
        seconds of the append (the replica's server's part: the events are made up here)."""
        r, rng, ev = self.rates, self.rng, []
        self._arrivals += r.requests_per_s * r.step_s
        while self._arrivals >= 1:
            self._arrivals -= 1
            ctx = rng.randrange(len(self.contexts))  # an agent's next turn: its context, a new tail
            tail = [rng.getrandbits(63) for _ in range(r.prompt_blocks - self.keep)]
            ev.append(BlocksQueued(self.contexts[ctx][: self.keep] + tail, f"s{ctx}"))
        self._debt += r.stored_blocks_per_s * r.step_s
        new = int(self._debt)
        self._debt -= new
        while new > 0:  # a request's chunk: up to 32 blocks chained to the engine's last ones
            k = min(new, rng.randint(1, 32))
            new -= k
            parent = self._parent if self._parent is not None and rng.random() < 0.9 else None
            hashes = list(range(self._next, self._next + k))
            self._next += k
            ev.append(BlockStored(hashes, parent, self.tokens[: k * BLOCK], BLOCK))
            self._held.extend(hashes)
            self._parent = hashes[-1]
        over = len(self._held) - self.cache_blocks
        if over > 0:  # KV pressure: one BlockRemoved for the step's evictions, oldest first
            ev.append(BlockRemoved([self._held.popleft() for _ in range(over)]))
        c0 = work_time()
        self.log.append(ev, now)
        return work_time() - c0


# -- a gateway's side ----------------------------------------------------------------------------


def _stride() -> tuple[int, ...]:
    """The endpoint's anchor stride, the config's (the tree before issue 42's anchors has none)."""
    params = inspect.signature(KVEventEndpoint).parameters
    return (AffinityConfig().claim_stride_blocks,) if "stride" in params else ()


def gateway_view(replicas: Sequence[str], index_capacity: int) -> BackendView:
    """The view and policy a gateway builds for a cache-aware backend (config defaults)."""
    params = AffinityParams(**{**AffinityConfig().params(), "index_capacity_blocks": index_capacity})
    view = BackendView("b", AffinityRouter(BLOCK, MODEL, params), ReplicaEjector(), 64)
    view.sync([ReplicaInfo(r, f"http://{r}", kv_events=True, kv_blocks=25_000) for r in replicas])
    return view


@dataclass
class Gateway:
    view: BackendView
    cursors: dict[str, FeedCursor]
    cpu_s: float = 0.0
    busy_until: float = 0.0
    lags: list[float] = field(default_factory=list)
    polls: int = 0
    events: int = 0


def serve_page(src: EngineSource, cursor: FeedCursor) -> tuple[KVEventPage, bytes]:
    """What ``KVEventEndpoint.handle`` computes for one poll (less aiohttp): the page and its body."""
    page = src.log.since(cursor.after, cursor.epoch)
    encoder = getattr(src.endpoint, "encoder", None)  # the tree before issue 42's change has none
    return page, encoder.encode(page) if encoder is not None else json.dumps(page_to_wire(page)).encode()


def apply_page(gw: Gateway, replica: str, body: bytes, now: float) -> KVEventPage:
    """What ``KVEventFeed._follow`` does with one answer (less aiohttp)."""
    from_json = getattr(kv_events, "page_from_json", None)  # the tree before it parsed in two passes
    page = from_json(body) if from_json is not None else page_from_wire(json.loads(body))
    gw.view.apply_kv_page(replica, page, now)
    gw.cursors[replica].advance(page)
    return page


def expire_recent(view: BackendView, now: float) -> float:
    """The recent sends' expiry that the gateway's next decision runs (``AffinityRouter.decide``):
    control-plane work too, since the events' ``BlocksQueued`` filled it. Returns its CPU seconds."""
    policy = view.policy
    assert policy is not None
    c0 = work_time()
    if policy.index._recent_log:
        policy.index.expire_recent(now - policy.params.recent_ttl_s)
    return work_time() - c0


# -- the simulation ------------------------------------------------------------------------------


def simulate(
    n: int,
    m: int,
    rates: Rates,
    seconds: float,
    cache_blocks: int,
    seed: int,
    applying: int = 2,
    push: bool = False,
    indexer: bool = False,
    shards: int = 1,
) -> dict[str, Any]:
    """N engines and M gateways for ``seconds`` of virtual time; per-role CPU and lag. Polled: every
    gateway polls every engine (the engine serves all M); pushed (``push``): each engine encodes
    each page once, ``FLUSH_S`` after its step, and every gateway takes it (ZMQ copies it to each:
    measured apart, see ``transport_overhead``). The first ``applying`` gateways also apply the
    pages (every gateway applies the same pages, so the others would only repeat it)."""
    gc0 = COLLECTOR.seconds
    out = _simulate(n, m, rates, seconds, cache_blocks, seed, applying, push, indexer, shards)
    out["sim_gc_s"] = round(COLLECTOR.seconds - gc0, 3)  # left out of every role's CPU (_Collector)
    return out


def _simulate(
    n: int,
    m: int,
    rates: Rates,
    seconds: float,
    cache_blocks: int,
    seed: int,
    applying: int,
    push: bool,
    indexer: bool,
    shards: int,
) -> dict[str, Any]:
    engines = [EngineSource(i, rates, cache_blocks, 32, seed * 1000 + i) for i in range(n)]
    names = [e.name for e in engines]
    gws = [Gateway(gateway_view(names, 1_000_000), {r: FeedCursor() for r in names}) for _ in range(m)]
    if indexer:
        return _simulate_indexed(engines, gws, rates, seconds, applying, shards)
    for gw in gws[:applying]:
        for e in engines:
            e.warm(gw.view)
    run = _run_pushed if push else _run_polled
    engine_cpu, t, pages = run(engines, gws, rates, seconds, applying, random.Random(seed))
    out = summarise(n, m, t, engines, gws[: min(m, applying)], engine_cpu)
    out["transport"] = "push" if push else "poll"
    if push:  # one page per engine push, to every gateway (no empty answers to long polls)
        out["polls_per_gateway_per_s"] = round(pages / t, 1)
        out["polls_per_engine_per_s"] = round(pages / n / t, 1)
    return out


def _gateway_takes(gw: Gateway, replica: str, body: bytes, due: float) -> None:
    """One gateway applying one page at ``due``: its CPU, and the lag of the page's batches."""
    c1 = work_time()
    page = apply_page(gw, replica, body, due)
    c2 = work_time()
    gw.cpu_s += c2 - c1
    gw.events += sum(len(b.events) for b in page.batches)
    gw.cpu_s += expire_recent(gw.view, due)
    gw.busy_until = max(due, gw.busy_until) + (c2 - c1)
    gw.lags.extend(gw.busy_until - b.ts for b in page.batches)


def _run_polled(
    engines: list[EngineSource],
    gws: list[Gateway],
    rates: Rates,
    seconds: float,
    applying: int,
    rng: random.Random,
) -> tuple[float, float, int]:
    """Every (gateway, engine) pair polls every MIN_POLL_S at its own phase."""
    polls = [(rng.uniform(0, MIN_POLL_S), g, e) for g in range(len(gws)) for e in range(len(engines))]
    heapq.heapify(polls)
    engine_cpu, clock, t = 0.0, work_time, 0.0
    while t < seconds:
        t += rates.step_s
        while polls[0][0] < t:  # the polls before this step's end see the events until the last one
            due, g, ei = heapq.heappop(polls)
            heapq.heappush(polls, (due + MIN_POLL_S, g, ei))
            src, gw = engines[ei], gws[g]
            c0 = clock()
            served, body = serve_page(src, gw.cursors[src.name])
            engine_cpu += clock() - c0
            gw.polls += 1
            if g >= applying:
                gw.cursors[src.name].advance(served)  # a gateway that only polls
                continue
            _gateway_takes(gw, src.name, body, due)
        for e in engines:
            engine_cpu += e.step(t)
    return engine_cpu, t, 0


def _run_pushed(
    engines: list[EngineSource],
    gws: list[Gateway],
    rates: Rates,
    seconds: float,
    applying: int,
    rng: random.Random,
) -> tuple[float, float, int]:
    """Each engine pushes what its step appended (``KVEventPublisher.flush``: the log's page since
    the last push, encoded once) ``FLUSH_S`` after the step; the applying gateways take it then."""
    from deployments.engine.kv_pub import FLUSH_S

    pushed = [0] * len(engines)
    engine_cpu, clock, t, pages = 0.0, work_time, 0.0, 0
    while t < seconds:
        t += rates.step_s
        for i, e in enumerate(engines):
            engine_cpu += e.step(t)
            if e.log.last_seq == pushed[i]:
                continue
            c0 = clock()
            page = e.log.since(pushed[i], e.log.epoch)
            body = e.endpoint.encoder.encode(page)
            engine_cpu += clock() - c0
            pushed[i], pages = page.last_seq, pages + 1
            for gw in gws[:applying]:
                gw.polls += 1
                _gateway_takes(gw, e.name, body, t + FLUSH_S)
    return engine_cpu, t, pages


@dataclass
class Indexer:
    """One indexer shard (``--design indexer``, cluster/routing/index_mirror.py): a router that
    takes every engine's pages (its own anchors of them), a single-server queue like a gateway's
    event loop."""

    builder: FrameBuilder
    cpu_s: float = 0.0
    busy_until: float = 0.0
    pages: int = 0
    frames: int = 0
    frame_bytes: int = 0
    anchors: int = 0
    pending: list[tuple[str, int, float]] = field(default_factory=list)  # taken batches: replica, seq, ts


def _simulate_indexed(
    engines: list[EngineSource], gws: list[Gateway], rates: Rates, seconds: float, applying: int, shards: int
) -> dict[str, Any]:
    """Each engine pushes its step's page once, ``FLUSH_S`` after the step (as ``_run_pushed``), to
    each of the ``shards`` indexers (each parses it whole: ZMQ topics could split it at the engine,
    not modelled); an indexer takes it when its loop is free; every ``FLUSH_S`` each publishes a
    frame of what changed, which the applying gateways decode and apply. Lag: a batch's step end
    -> the last of the shards' frames that carry it applied on a gateway."""
    from deployments.engine.kv_pub import FLUSH_S

    names = [e.name for e in engines]
    ixs = [Indexer(FrameBuilder(_policy(gateway_view(names, 1_000_000)), s, shards)) for s in range(shards)]
    for ix in ixs:  # the steady state, as in simulate(): the indexer has seen each context once
        for e in engines:
            e.warm_router(ix.builder)
        first = ix.builder.flush(0.0)  # its first frame carries them, applied untimed
        warm = encode_frame(first) if first is not None else b""
        for gw in gws[:applying] if warm else ():
            gw.view.apply_index_frame(decode_frame(warm), 0.0)
    pushed, engine_cpu, clock, t, next_flush = [0] * len(engines), 0.0, work_time, 0.0, FLUSH_S
    done: list[dict[tuple[str, int, float], float]] = [{} for _ in gws[:applying]]  # batch -> applied
    while t < seconds:
        t += rates.step_s
        for i, e in enumerate(engines):
            engine_cpu += e.step(t)
            if e.log.last_seq == pushed[i]:
                continue
            c0 = clock()
            page = e.log.since(pushed[i], e.log.epoch)
            body = e.endpoint.encoder.encode(page)
            engine_cpu += clock() - c0
            pushed[i] = page.last_seq
            for ix in ixs:
                _indexer_takes(ix, e.name, body, t + FLUSH_S)
        while next_flush <= t + FLUSH_S:
            for ix in ixs:
                _indexer_flushes(ix, gws[:applying], done, next_flush)
            next_flush += FLUSH_S
    for gw, applied in zip(gws, done, strict=False):
        gw.events = len(applied)
        gw.lags = [at - ts for (_, _, ts), at in applied.items()]
    size = len(_policy(gws[0].view).index)
    return _indexed_row(engines, gws, gws[:applying], ixs, (t, engine_cpu), floor_size=size)


def _policy(view: BackendView) -> AffinityRouter:
    assert view.policy is not None
    return view.policy


def _indexed_row(
    engines: Sequence[EngineSource],
    gws: Sequence[Gateway],
    applying: Sequence[Gateway],
    ixs: Sequence[Indexer],
    clocks: tuple[float, float],
    floor_size: int,
) -> dict[str, Any]:
    """The sweep point's row; ``clocks``: (virtual seconds, the engines' CPU seconds)."""
    t, engine_cpu = clocks
    out = summarise(len(engines), len(gws), t, engines, applying, engine_cpu)
    floor_ns = mirror_floor_ns(floor_size)
    frames, anchors = sum(ix.frames for ix in ixs), sum(ix.anchors for ix in ixs)
    out.update(
        transport="push",
        design="indexer",
        indexer_shards=len(ixs),
        indexer_cpu_share=round(max(ix.cpu_s for ix in ixs) / t, 5),  # the busiest shard's
        indexer_cpu_share_all_shards=round(sum(ix.cpu_s for ix in ixs) / t, 5),
        indexer_pages_per_s=round(max(ix.pages for ix in ixs) / t, 1),
        frames_per_s=round(frames / t, 1),
        frame_kb_mean=round(sum(ix.frame_bytes for ix in ixs) / max(1, frames) / 1024, 2),
        frame_anchors_per_s=round(anchors / t, 1),
        mirror_floor_ns_per_anchor=round(floor_ns, 1),
        mirror_floor_cpu_share=round(anchors / t * floor_ns / 1e9, 5),
        polls_per_gateway_per_s=round(frames / t, 1),
        polls_per_engine_per_s=round(max(ix.pages for ix in ixs) / len(engines) / t, 1),  # one PUB send
        connections_per_gateway=len(ixs),
        connections_per_engine=len(ixs),
        connections_total=(len(engines) + len(gws)) * len(ixs),
    )
    return out


def mirror_floor_ns(size: int, batch: int = 20_000, rounds: int = 10) -> float:
    """The box's floor for a mirror: nanoseconds per anchor of the bare C-level operations a frame
    needs (``dict.update`` of new anchors from packed arrays, then ``pop`` of as many) on a plain
    dict of the mirror's size, no code of ours around them."""
    rng = random.Random(5)
    d = {rng.getrandbits(63): 1 for _ in range(max(size, 1))}
    bits = {s: 1 << s for s in range(256)}
    total = 0.0
    for _ in range(rounds):
        keys = array("q", [rng.getrandbits(63) for _ in range(batch)])
        slots = array("H", [rng.randrange(256) for _ in range(batch)])
        t0 = time.perf_counter()
        d.update(zip(keys, map(bits.__getitem__, slots), strict=True))
        deque(map(d.pop, keys, repeat(None)), maxlen=0)
        total += time.perf_counter() - t0
    return total / rounds / (2 * batch) * 1e9


def _indexer_takes(ix: Indexer, replica: str, body: bytes, due: float) -> None:
    """One engine page at ``due`` on an indexer: parsed and applied (``FrameBuilder.take``)."""
    c0 = work_time()
    page = kv_events.page_from_json(body)
    ix.builder.take(replica, page, due)
    cost = work_time() - c0
    ix.cpu_s += cost
    ix.busy_until = max(due, ix.busy_until) + cost
    ix.pages += 1
    ix.pending.extend((replica, b.seq, b.ts) for b in page.batches)


def _indexer_flushes(
    ix: Indexer, gws: Sequence[Gateway], done: list[dict[tuple[str, int, float], float]], due: float
) -> None:
    """The frame at ``due`` (or when the indexer's loop is free): built, encoded, applied; each
    gateway notes when each batch it carries was applied (the last shard's counts)."""
    c0 = work_time()
    frame = ix.builder.flush(due)
    body = encode_frame(frame) if frame is not None else b""
    cost = work_time() - c0
    ix.cpu_s += cost
    stamps, ix.pending = ix.pending, []
    sent = max(due, ix.busy_until) + cost
    ix.busy_until = sent
    if frame is not None:
        ix.frames += 1
        ix.frame_bytes += len(body)
        ix.anchors += frame.anchors()
    for gw, applied in zip(gws, done, strict=True):
        took = 0.0
        if frame is not None:
            c1 = work_time()
            gw.view.apply_index_frame(decode_frame(body), sent)
            took = work_time() - c1
            gw.cpu_s += took
            gw.polls += 1
        gw.busy_until = max(sent, gw.busy_until) + took
        for key in stamps:
            applied[key] = max(applied.get(key, 0.0), gw.busy_until)


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarise(
    n: int, m: int, seconds: float, engines: Sequence[EngineSource], gws: Sequence[Gateway], engine_cpu: float
) -> dict[str, Any]:
    lags = [x for g in gws for x in g.lags]
    batches = sum(e.log.last_seq for e in engines)
    events = sum(g.events for g in gws) / len(gws)
    polled = sum(g.polls for g in gws)
    policy = gws[0].view.policy
    assert policy is not None
    return {
        "kv_map_bytes_per_entry": round(per_entry(policy).get("kv_maps", 0.0), 1),
        "n": n,
        "m": m,
        "gateways_applying": len(gws),
        "virtual_s": round(seconds, 3),
        "gateway_cpu_share": round(sum(g.cpu_s for g in gws) / len(gws) / seconds, 5),
        "engine_serialize_cpu_share": round(engine_cpu / n / seconds, 6),
        "lag_p50_ms": round(pct(lags, 0.5) * 1000, 2),
        "lag_p99_ms": round(pct(lags, 0.99) * 1000, 2),
        "polls_per_gateway_per_s": round(polled / len(gws) / seconds, 1),
        "polls_per_engine_per_s": round(polled / len(gws) * m / n / seconds, 1),
        "events_per_gateway_per_s": round(events / seconds, 1),
        "batches_per_engine_per_s": round(batches / n / seconds, 1),
        "gateway_cpu_us_per_event": round(sum(g.cpu_s for g in gws) / len(gws) / max(events, 1) * 1e6, 3),
        "connections_per_gateway": n,
        "connections_per_engine": m,
        "connections_total": n * m,
    }


# -- index memory and the decision at the steady-state size ---------------------------------------


def _int_bytes(d: dict[Any, Any]) -> int:
    """A dict's table plus its int keys and int (or tuple-of-shared-str-and-int) values."""
    total = sys.getsizeof(d)
    for k, v in d.items():
        total += sys.getsizeof(k) + sys.getsizeof(v)
        if isinstance(v, tuple):
            total += sum(sys.getsizeof(x) for x in v if isinstance(x, int))
    return total


def router_bytes(policy: AffinityRouter) -> dict[str, int]:
    """The index's structures, by a ``sys.getsizeof`` walk (replica names are shared, not counted)."""
    idx = policy.index
    return {
        "index_map": _int_bytes(idx._map),
        "recent": _int_bytes(idx._recent) + sum(sys.getsizeof(x) for x in idx._recent_log),
        "stored_by": _int_bytes(policy._stored_by),
        "homes": _int_bytes(policy.homes._home),
        "kv_maps": sum(_int_bytes(getattr(m, "_map", m)) for m in policy._kv_maps.values()),
    }


def per_entry(policy: AffinityRouter) -> dict[str, float]:
    """Bytes per entry of each structure, from a filled router."""
    sizes = router_bytes(policy)
    counts = {
        "index_map": len(policy.index._map),
        "stored_by": len(policy._stored_by),
        "homes": len(policy.homes._home),
        "kv_maps": sum(len(m) for m in policy._kv_maps.values()),
    }
    return {k: sizes[k] / counts[k] for k in counts if counts[k]}


def _anchors(chain: list[int], stride: int) -> list[int]:
    """``block_hash.strided`` (every k-th block and the last), which the tree before it lacks."""
    if stride <= 1:
        return chain
    return chain[stride - 1 :: stride] + ([chain[-1]] if len(chain) % stride else [])


def fill_steady(n: int, kv_blocks: int, cap: int, seed: int) -> tuple[BackendView, list[list[int]], int]:
    """A gateway view of N replicas whose index holds what N full caches hold (at most the index's
    capacity): 256-block chains (4k-token contexts) stored by random replicas, as their events
    would (index, last-stored-by, homes; with an anchor stride k, the chains' anchors: N caches
    are k times fewer entries). Returns the view, some chains, the entries."""
    rng = random.Random(seed)
    names = [f"engine-{i}" for i in range(n)]
    view = gateway_view(names, cap)
    policy = view.policy
    assert policy is not None
    stride = getattr(policy.index, "stride", 1) if _stride() else 1  # what the engines publish
    target = min(cap, -(-n * kv_blocks // stride))
    chains: list[list[int]] = []
    while len(policy.index) < target:
        chain = [rng.getrandbits(63) for _ in range(256)]
        anchors = _anchors(chain, stride)
        r = names[rng.randrange(n)]
        policy.event_fed.add(r)
        policy.index.on_block_stored(r, anchors)
        policy.homes.claim(r, chain)
        if getattr(policy, "_last_homes", True):  # kept only for new_prefix least_loaded (issue 42)
            for h in anchors:
                policy._stored_by[h] = r
        if len(chains) < 4096:
            chains.append(chain)
    return view, chains, target


def decision_times(view: BackendView, chains: Sequence[list[int]], n: int, seed: int) -> dict[str, float]:
    """``BackendView.choose`` for 4k-token prompts, half of them a held context plus a new turn,
    half new: microseconds p50/p99 over ``n`` decisions (after a warm-up). Timed as configured
    (``decision_candidates``: a bounded set over more replicas, cluster/routing/candidates.py)
    and, where the config has the knob, scoring every replica (``decision_full_``) on the same
    index, with the bounded decisions' matched blocks over the full ones' (the hits kept)."""
    policy = view.policy
    assert policy is not None
    configured = policy.params
    runs = [("", configured)]
    if getattr(configured, "decision_candidates", 0):  # the tree before issue 42's change has none
        runs.append(("full_", dataclasses.replace(configured, decision_candidates=0)))
    out: dict[str, float] = {}
    matched: dict[str, int] = {}
    for name, params in runs:
        policy.params = params
        view.rng = random.Random(seed)
        samples, matched[name] = _time_choices(view, chains, n, seed)
        out[f"decision_{name}p50_us"] = round(pct(samples, 0.5), 2)
        out[f"decision_{name}p99_us"] = round(pct(samples, 0.99), 2)
    policy.params = configured
    if "full_" in matched:
        out["decision_matched_ratio"] = round(matched[""] / max(1, matched["full_"]), 4)
    out.update(timing_floor(out["decision_p50_us"], n))
    return out


def timing_floor(p50_us: float, n: int) -> dict[str, float]:
    """The box's own tail at the decision's size: one fixed piece of pure Python (the same work
    every time) of about the decisions' p50, timed ``n`` times as they are. Its p99 is what this
    machine adds to any such call; the decisions' p99 above it is their own."""
    clock, k = time.perf_counter_ns, 256

    def work(k: int) -> int:
        return sum(i * i for i in range(k))

    for _ in range(12):  # calibrate: k so that the work's median is the decisions' p50
        t = sorted(_timed(work, k, 51, clock))[25]
        k = max(16, int(k * p50_us / max(t, 0.1)))
    samples = _timed(work, k, n + 200, clock)[200:]
    return {
        "decision_floor_p50_us": round(pct(samples, 0.5), 2),
        "decision_floor_p99_us": round(pct(samples, 0.99), 2),
    }


def _timed(fn: Any, arg: int, n: int, clock: Any) -> list[float]:
    """Microseconds of ``fn(arg)``, ``n`` times."""
    out = []
    for _ in range(n):
        t0 = clock()
        fn(arg)
        out.append((clock() - t0) / 1000)
    return out


def _time_choices(
    view: BackendView, chains: Sequence[list[int]], n: int, seed: int
) -> tuple[list[float], int]:
    """Microseconds per ``choose`` after 200 warm-up decisions, and the blocks matched in all."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n + 200):
        base = chains[rng.randrange(len(chains))][: rng.randint(64, 240)] if i % 2 else []
        reqs.append(
            (base + [rng.getrandbits(63) for _ in range(256 - len(base))], f"s{rng.randrange(10_000)}")
        )
    samples, clock, hits = [], time.perf_counter_ns, 0
    for i, (hashes, session) in enumerate(reqs):
        t0 = clock()
        choice = view.choose(hashes, 1.0 + i * 1e-3, session)
        t1 = clock()
        if i >= 200:
            samples.append((t1 - t0) / 1000)
            hits += choice.decision.matched_blocks if choice is not None else 0
    return samples, hits


def steady_state(n: int, kv_blocks: int, cap: int, kv_bytes: float, seed: int) -> dict[str, Any]:
    """Index memory and decision time at the steady-state size for N engines. ``kv_bytes``: bytes
    per entry of the engine-hash maps (measured in the simulation), which hold N x min(KV blocks,
    ``kv_map_capacity``) entries in all."""
    view, chains, entries = fill_steady(n, kv_blocks, cap, seed)
    policy = view.policy
    assert policy is not None
    stride = getattr(policy.index, "stride", 1) if _stride() else 1
    sizes = router_bytes(policy)
    kv_entries = n * min(kv_blocks, policy.params.kv_map_capacity)
    total = sum(sizes.values()) + kv_bytes * kv_entries
    out = {
        "n": n,
        "index_entries": entries,
        "index_capacity_blocks": cap,
        "index_stride": stride,  # entries are anchors: each stands for this many cached blocks
        "index_blocks_covered": entries * stride,
        "kv_map_entries": kv_entries,
        "index_mb": round(total / 2**20, 1),
        "index_bytes_per_block": round(total / max(1, entries)),
        "index_mb_parts": {k: round(v / 2**20, 1) for k, v in sizes.items()}
        | {"kv_maps": round(kv_bytes * kv_entries / 2**20, 1)},
        **decision_times(view, chains, 2000, seed),
    }
    del view, chains
    return out


# -- the real HTTP long poll on loopback (kv_endpoint <-> kv_feed), small N ----------------------


def _proc_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _serve(
    n: int, rates: Rates, cache_blocks: int, port: int, seconds: float, push: bool = False
) -> None:
    """N engines' ``KVEventEndpoint`` on one aiohttp server (``/e{i}/kv_events``), their events
    generated in real time; ``/cpu`` answers this process's CPU seconds and the polls served (with
    ``push``: the pages their ``KVEventPublisher``s pushed, and ``/pubs`` their addresses)."""
    from aiohttp import web

    from deployments.engine.kv_pub import KVEventPublisher

    engines = [EngineSource(i, rates, cache_blocks, 32, 7000 + i) for i in range(n)]
    pubs = [KVEventPublisher(e.endpoint, e.name, "127.0.0.1", TOKEN) for e in engines] if push else []
    served = [0]
    app = web.Application()
    for i, e in enumerate(engines):
        ep = e.endpoint

        async def handle(request: web.Request, ep: KVEventEndpoint = ep) -> web.Response:
            served[0] += 1
            return await ep.handle(request)

        app.router.add_get(f"/e{i}/kv_events", handle)

    async def cpu(_: web.Request) -> web.Response:
        pages = sum(p.pages + p.heartbeats for p in pubs)
        return web.json_response({"cpu_s": _proc_cpu(), "polls": pages if push else served[0]})

    async def addresses(_: web.Request) -> web.Response:
        return web.json_response([p.address for p in pubs])

    app.router.add_get("/cpu", cpu)
    app.router.add_get("/pubs", addresses)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    start = time.monotonic()
    t = 0.0
    while time.monotonic() - start < seconds:
        t += rates.step_s
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        for e in engines:
            e.step(time.time())
    for p in pubs:
        p.close()
    await runner.cleanup()


class _Picker:
    async def refresh(self) -> None:  # the replica list is fixed: nothing to ask Serve
        return None


async def _consume(
    n: int, m: int, rates: Rates, cache_blocks: int, port: int, seconds: float, push: bool = False
) -> dict[str, Any]:
    """M gateways' real ``KVEventFeed`` (one aiohttp session each, as a gateway has) following N
    engines for ``seconds``; CPU of this process and of the engines' server, polls served."""
    import aiohttp

    from deployments.gateway.kv_feed import KVEventFeed

    base = f"http://127.0.0.1:{port}"
    names = [f"engine-{i}" for i in range(n)]
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) for _ in range(m)]
    twins = [EngineSource(i, rates, cache_blocks, 32, 7000 + i) for i in range(n)]  # the server's contexts
    feeds = []
    async with aiohttp.ClientSession() as probe:
        for _ in range(120):  # the server's child is up (slow to start on a busy box) ...
            try:
                async with probe.get(base + "/pubs") as r:
                    pubs = await r.json()
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.5)
        for g in range(m):
            view = gateway_view(names, 1_000_000)
            infos = [
                ReplicaInfo(r, f"{base}/e{i}", kv_events=True, kv_pub=pubs[i] if push else None)
                for i, r in enumerate(names)
            ]
            view.sync(infos)
            for e in twins:
                e.warm(view)
            feeds.append(KVEventFeed(view, _Picker(), lambda s=sessions[g]: s, TOKEN))
        await asyncio.sleep(1.0)  # ... and publishing
        async with probe.get(base + "/cpu") as r:
            before = await r.json()
        c0 = _proc_cpu()
        tasks = [asyncio.create_task(f.run()) for f in feeds]
        await asyncio.sleep(seconds)
        client_cpu = _proc_cpu() - c0
        async with probe.get(base + "/cpu") as r:
            after = await r.json()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in sessions:
        await s.close()
    events = sum(c.events for f in feeds for c in f.cursors.values())
    return {
        "client_cpu_s": client_cpu,
        "server_cpu_s": after["cpu_s"] - before["cpu_s"],
        "polls": after["polls"] - before["polls"] - 1,
        "events_applied": events,
        "feed_errors": sum(f.errors for f in feeds),
        "log_asks": sum(f.asks for f in feeds),
        "pushed_messages": sum(f.sub.messages for f in feeds if f.sub is not None),
    }


def http_run(
    n: int, m: int, rates: Rates, cache_blocks: int, seconds: float, port: int, push: bool = False
) -> dict[str, Any]:
    """The loopback run: the engines' server in a child process, the gateways here."""
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "loadtest.benchmarks.bench_control_plane",
        "--serve",
        str(n),
        "--port",
        str(port),
    ]
    cmd += ["--serve-seconds", str(seconds + 3), "--rate-scale", str(RATE_SCALE_HTTP)]
    cmd += ["--transport", "push" if push else "poll"]
    child = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2])
    try:
        raw = asyncio.run(_consume(n, m, rates, cache_blocks, port, seconds, push))
    finally:
        child.wait(timeout=30)
    polls = max(raw["polls"], 1)  # pushed: the pages (each reaches all M gateways)
    deliveries = polls * (m if push else 1)
    return {
        "n": n,
        "m": m,
        "transport": "push" if push else "poll",
        "seconds": seconds,
        "rate_scale": RATE_SCALE_HTTP,
        **raw,
        "gateway_cpu_share": round(raw["client_cpu_s"] / m / seconds, 4),
        "engine_cpu_share": round(raw["server_cpu_s"] / n / seconds, 5),
        "polls_per_engine_per_s": round(polls / n / seconds, 1),
        "server_cpu_us_per_poll": round(raw["server_cpu_s"] / polls * 1e6, 1),
        "client_cpu_us_per_poll": round(raw["client_cpu_s"] / deliveries * 1e6, 1),
    }


RATE_SCALE_HTTP = 0.25  # the loopback runs publish a quarter of the rates: both sides fit on 2 cores


# -- the sweep, the fits, the report -------------------------------------------------------------


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares exponent b of y = a * x^b."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def fits(sweep: Sequence[dict[str, Any]], ns: Sequence[int], ms: Sequence[int]) -> dict[str, Any]:
    """Growth exponents, and the N at which a gateway's control plane fills the 5 % goal and one
    whole core (its event loop: beyond it the lag grows without bound), whatever the node's cores."""
    m0, n0 = ms[-1], ns[-1]
    gw = [next(r for r in sweep if r["n"] == n and r["m"] == m0) for n in ns]
    en = [next(r for r in sweep if r["n"] == n0 and r["m"] == m) for m in ms]
    b = slope(ns, [r["gateway_cpu_share"] for r in gw])
    a = gw[-1]["gateway_cpu_share"] / ns[-1] ** b
    return {
        "gateway_cpu_share_exponent_in_n": round(b, 3),
        "gateway_cpu_share_exponent_in_m": round(
            slope(ms, [r["gateway_cpu_share"] for r in en]) if len(ms) > 1 else 0.0, 3
        ),
        "engine_cpu_share_exponent_in_m": round(slope(ms, [r["engine_cpu_share"] for r in en]), 3),
        "engine_cpu_share_exponent_in_n": round(slope(ns, [r["engine_cpu_share"] for r in gw]), 3),
        "index_mb_exponent_in_n": round(slope(ns, [r["index_mb"] for r in gw]), 3),
        "decision_p99_us_exponent_in_n": round(slope(ns, [r["decision_p99_us"] for r in gw]), 3),
        "gateway_n_at_5pct_core": round((0.05 / a) ** (1 / b), 1),
        "gateway_n_at_one_core": round((1.0 / a) ** (1 / b), 1),
        "gateway_replicas_per_32_core_node_at_max_n": round(32 / gw[-1]["gateway_cpu_share"], 1),
    }


def run_sweep(
    args: argparse.Namespace, rates: Rates, kv_blocks: int, http: dict[str, float]
) -> list[dict[str, Any]]:
    """The N x M sweep; ``http``: the HTTP layer's CPU per poll on each side (µs), added per poll."""
    rows = []
    for n in args.n:
        state = None
        for m in args.m:
            t0 = time.monotonic()
            push, indexer = args.transport == "push", args.design == "indexer"
            r = simulate(
                n,
                m,
                rates,
                args.seconds,
                args.sim_cache_blocks,
                args.seed,
                push=push,
                indexer=indexer,
                shards=args.shards,
            )
            if state is None:
                kv_bytes = r["kv_map_bytes_per_entry"]
                state = steady_state(n, kv_blocks, args.index_capacity, kv_bytes, args.seed)
            r.update({k: v for k, v in state.items() if k != "n"})
            r["gateway_apply_cpu_share"] = r["gateway_cpu_share"]
            r["gateway_http_cpu_share"] = round(r["polls_per_gateway_per_s"] * http["client_us"] / 1e6, 5)
            r["gateway_cpu_share"] = round(r["gateway_apply_cpu_share"] + r["gateway_http_cpu_share"], 5)
            per_m = http.get("server_us_per_m", 0.0)
            per_poll = http["server_us"] + per_m * (args.shards if indexer else m)  # indexer: its shards
            r["engine_http_cpu_share"] = round(r["polls_per_engine_per_s"] * per_poll / 1e6, 6)
            if indexer:  # its SUB takes every engine's pages; its PUB sends each frame to M gateways
                took = r["indexer_pages_per_s"] * http["client_us"]
                sent = r["frames_per_s"] / args.shards * (http["server_us"] + per_m * m)  # one shard's
                r["indexer_apply_cpu_share"] = r["indexer_cpu_share"]
                r["indexer_http_cpu_share"] = round((took + sent) / 1e6, 5)
                r["indexer_cpu_share"] = round(r["indexer_apply_cpu_share"] + r["indexer_http_cpu_share"], 5)
                all_http = r["indexer_http_cpu_share"] * args.shards  # each shard takes every page
                r["indexer_cpu_share_all_shards"] = round(r["indexer_cpu_share_all_shards"] + all_http, 5)
            r["engine_cpu_share"] = round(r["engine_serialize_cpu_share"] + r["engine_http_cpu_share"], 6)
            r["gateway_saturated"] = r["gateway_cpu_share"] >= 1.0
            r["wall_s"] = round(time.monotonic() - t0, 1)
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def http_overhead(args: argparse.Namespace, rates: Rates) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Loopback runs at small N; the transport's CPU per poll (pushed: per page an engine sends, per
    page a gateway takes) on each side is the run's less the in-process simulation's (same N, M
    and scaled rates) for the same work. An engine's per page grows with M when pushed (ZMQ copies
    it to each gateway): ``server_us`` + ``server_us_per_m`` x M, fitted over the runs' M."""
    push = args.transport == "push"
    scaled = rates.scaled(RATE_SCALE_HTTP)
    runs, server, client, ms = [], [], [], []
    for n, m in args.http:
        h = http_run(n, m, scaled, args.sim_cache_blocks, args.http_seconds, args.port, push)
        sim = simulate(n, m, scaled, 3.0, args.sim_cache_blocks, args.seed, applying=m, push=push)
        sim_polls = sim["polls_per_engine_per_s"] * n * sim["virtual_s"]
        h["inprocess_server_us_per_poll"] = round(
            sim["engine_serialize_cpu_share"] * n * sim["virtual_s"] / sim_polls * 1e6, 1
        )
        h["inprocess_client_us_per_poll"] = round(
            sim["gateway_cpu_share"] * m * sim["virtual_s"] / (sim_polls * (m if push else 1)) * 1e6, 1
        )
        h["http_server_us_per_poll"] = round(
            h["server_cpu_us_per_poll"] - h["inprocess_server_us_per_poll"], 1
        )
        h["http_client_us_per_poll"] = round(
            h["client_cpu_us_per_poll"] - h["inprocess_client_us_per_poll"], 1
        )
        print(json.dumps(h), flush=True)
        runs.append(h)
        server.append(h["http_server_us_per_poll"])
        client.append(h["http_client_us_per_poll"])
        ms.append(m)
    per_m = 0.0
    if push and len(set(ms)) > 1:  # least squares of server = a + b M
        mm, sm = sum(ms) / len(ms), sum(server) / len(server)
        per_m = sum((x - mm) * (y - sm) for x, y in zip(ms, server, strict=True)) / sum(
            (x - mm) ** 2 for x in ms
        )
        per_m = max(0.0, per_m)
    base = min(y - per_m * x for x, y in zip(ms, server, strict=True)) if server else 0.0
    return runs, {"server_us": max(0.0, base), "server_us_per_m": per_m, "client_us": max(0.0, min(client))}


def flat_keys(prefix: str, row: dict[str, Any]) -> dict[str, Any]:
    keys = ("gateway_cpu_share", "engine_cpu_share", "lag_p99_ms", "decision_p99_us", "index_mb")
    extra = ("indexer_cpu_share", "mirror_floor_cpu_share")  # the indexer design's
    return {f"{prefix}_{k}": row[k] for k in keys} | {f"{prefix}_{k}": row[k] for k in extra if k in row}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--profile", default="llama-3.1-8b-h100")
    ap.add_argument(
        "--utilisation", type=float, default=0.5, help="share of each step's token budget in prefill"
    )
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument(
        "--reuse", type=float, default=0.8, help="share of a prompt's tokens cached (prefix reuse)"
    )
    ap.add_argument("--decode-seqs", type=int, default=64)
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--m", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--seconds", type=float, default=1.5, help="virtual seconds per sweep point")
    ap.add_argument("--sim-cache-blocks", type=int, default=1024, help="an engine's cache in the simulation")
    ap.add_argument(
        "--index-capacity",
        type=int,
        default=getattr(AffinityConfig(), "index_capacity_blocks", 1_000_000),
        help="the index's bound in blocks (default: the config's index_capacity_blocks)",
    )
    ap.add_argument(
        "--http", type=lambda s: tuple(map(int, s.split("x"))), nargs="*", default=[(16, 2), (16, 8), (64, 2)]
    )
    ap.add_argument("--http-seconds", type=float, default=8.0)
    ap.add_argument("--port", type=int, default=18642)
    ap.add_argument(
        "--design",
        default="before",
        help="the key prefix the N-max, M-max point is written under; 'indexer' also runs that design"
        " (one indexer per backend, gateways mirror it: cluster/routing/index_mirror.py)",
    )
    ap.add_argument(
        "--shards", type=int, default=1, help="--design indexer: indexers, each owning anchors h % shards"
    )
    ap.add_argument(
        "--transport",
        choices=["push", "poll"],
        default=getattr(AffinityConfig(), "kv_transport", "poll"),
        help="how events reach the gateways (default: the config's affinity.kv_transport)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--code-note", default="", help="what code ran, when not the checkout's (provenance)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (not for the result file)")
    ap.add_argument("--out", default=str(RESULTS / "control_plane.json"))
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # the loopback child
    ap.add_argument("--serve-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--rate-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.http_seconds, args.http = 0.5, 3.0, [(16, 2)]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    profile = get_profile(args.profile)
    rates = engine_rates(profile, args.utilisation, args.prompt_tokens, args.reuse, args.decode_seqs)
    if args.serve:
        run = _serve(
            args.serve,
            rates.scaled(args.rate_scale),
            args.sim_cache_blocks,
            args.port,
            args.serve_seconds,
            args.transport == "push",
        )
        asyncio.run(run)
        return 0
    started, git, load = time.monotonic(), git_state(), os.getloadavg()
    http_runs, http = http_overhead(args, rates) if args.http else ([], {"server_us": 0.0, "client_us": 0.0})
    print(json.dumps({"transport": args.transport, "per_poll_us": http}), flush=True)
    sweep = run_sweep(args, rates, profile.num_kv_blocks(), http)
    top = next(r for r in sweep if r["n"] == max(args.n) and r["m"] == max(args.m))
    path = Path(args.out)
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    report.update(flat_keys(args.design, top))
    report[f"{args.design}_sweep"] = sweep
    if len(args.n) > 1 and len(args.m) > 1:
        report[f"{args.design}_fits"] = fits(sweep, args.n, args.m)
    report[f"{args.design}_http_loopback"] = {"runs": http_runs, "per_poll_us": http}
    report[f"{args.design}_transport"] = args.transport
    report[f"{args.design}_provenance"] = provenance(argv or sys.argv[1:], git, load, started)
    if args.code_note:
        report[f"{args.design}_provenance"]["code"] = args.code_note
    if args.design != "indexer":  # RESULTS.md's row is the shipped design's: an opt-in one leaves it
        report["provenance"] = report[f"{args.design}_provenance"]  # the last such run's
    report["workload"] = {
        "profile": args.profile,
        "kv_blocks_per_engine": profile.num_kv_blocks(),
        "utilisation": args.utilisation,
        "prompt_tokens": args.prompt_tokens,
        "reuse": args.reuse,
        "decode_seqs": args.decode_seqs,
        "block_size": BLOCK,
        "min_poll_s": MIN_POLL_S,
        "anchor_stride": (_stride() or (1,))[0],  # engines publish every k-th block of a chain and its last
        "rates_per_engine": rates.as_dict(),
    }
    if args.quick:
        print(json.dumps(report, indent=2))
        return 0
    write_report(report, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
