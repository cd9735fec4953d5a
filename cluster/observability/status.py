"""What ``cluster status`` shows, from scrapes of the cluster's metrics endpoint: one row per
gateway replica, per engine replica and per backend. Pure: scrapes in, rows out.

Rates and quantiles are taken between the oldest and the newest scrape of a sliding window (the
last minute with ``--watch``); from a single scrape they cover the time since each process started
and rates are unknown. Counters that went backwards (a restarted process) count from zero.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cluster.observability.prometheus import Sample, bucket_counts, quantile

P = "ray_llmc_"
BREAKER_NAMES = {0: "closed", 1: "open", 2: "half-open"}
_WORKER = "WorkerId"  # Ray's label for the process that recorded a sample


@dataclass(frozen=True)
class Scrape:
    at: float  # seconds, any monotonic clock
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class GatewayRow:
    replica: str
    in_flight: int
    waiting: int
    rps: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


@dataclass(frozen=True)
class EngineRow:
    backend: str
    replica: str
    running: int
    waiting: int
    kv_usage: float
    hit_rate: float | None
    breaker: str
    rps: float | None


@dataclass(frozen=True)
class BackendRow:
    backend: str
    breaker: str
    rps: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


@dataclass(frozen=True)
class Status:
    window_s: float | None  # None: one scrape, totals since start
    gateways: list[GatewayRow] = field(default_factory=list)
    engines: list[EngineRow] = field(default_factory=list)
    backends: list[BackendRow] = field(default_factory=list)


class Window:
    """Scrapes no older than ``span_s`` behind the newest (one older kept so the span is full)."""

    def __init__(self, span_s: float = 60.0) -> None:
        self.span_s = span_s
        self.scrapes: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> None:
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and scrape.at - self.scrapes[1].at >= self.span_s:
            self.scrapes.popleft()

    def status(self) -> Status:
        if not self.scrapes:
            return Status(window_s=None)
        old = self.scrapes[0] if len(self.scrapes) > 1 else None
        return summarize(old, self.scrapes[-1])


def _key(s: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return s.name, tuple(sorted(s.labels.items()))


def increase(old: Scrape | None, new: Scrape) -> list[Sample]:
    """Cumulative series (counters, histogram parts) as their increase from ``old`` to ``new``;
    every other series as its value in ``new``."""
    before = {_key(s): s.value for s in old.samples} if old else {}
    out = []
    for s in new.samples:
        if s.name.endswith(("_total", "_bucket", "_count", "_sum")):
            prev = before.get(_key(s), 0.0)
            out.append(Sample(s.name, s.labels, s.value - prev if s.value >= prev else s.value))
        else:
            out.append(s)
    return out


def summarize(old: Scrape | None, new: Scrape) -> Status:
    dt = new.at - old.at if old is not None and new.at > old.at else None
    delta = increase(old, new) if dt else list(new.samples)
    return Status(
        window_s=dt,
        gateways=_gateways(new.samples, delta, dt),
        engines=_engines(new.samples, delta, dt),
        backends=_backends(new.samples, delta, dt),
    )


def _ms(v: float | None) -> float | None:
    return None if v is None else 1000 * v


def _ttft(samples: Iterable[Sample]) -> tuple[float | None, float | None]:
    b = bucket_counts(samples, P + "ttft_seconds")
    return _ms(quantile(0.5, b)), _ms(quantile(0.99, b))


def _rate(total: float, dt: float | None) -> float | None:
    return total / dt if dt else None


def _gateways(
    now: list[Sample] | tuple[Sample, ...], delta: list[Sample], dt: float | None
) -> list[GatewayRow]:
    """A gateway replica's gauges carry its Serve replica id; its counters and histograms only the
    process's WorkerId, which the gauges map to the replica."""
    names: dict[str, str] = {}
    load: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s in now:
        if s.name in (P + "gateway_requests_in_flight", P + "gateway_requests_waiting"):
            replica = s.label("gateway") or s.label(_WORKER)[:8]
            names[s.label(_WORKER)] = replica
            load[replica][0 if s.name.endswith("in_flight") else 1] += int(s.value)
    by_replica: dict[str, list[Sample]] = defaultdict(list)
    for s in delta:
        if s.name == P + "requests_ended_total" or s.name.startswith(P + "ttft_seconds"):
            worker = s.label(_WORKER)
            by_replica[names.get(worker, worker[:8])].append(s)
    rows = []
    for replica in sorted(set(load) | set(by_replica)):
        series = by_replica.get(replica, [])
        ended = sum(s.value for s in series if s.name == P + "requests_ended_total")
        p50, p99 = _ttft(series)
        in_flight, waiting = load.get(replica, [0, 0])
        rows.append(GatewayRow(replica, in_flight, waiting, _rate(ended, dt), p50, p99))
    return rows


def _breakers(now: Iterable[Sample]) -> dict[tuple[str, str], int]:
    """The worst state any gateway replica holds, per (backend, replica); replica "" is the
    backend's own breaker."""
    out: dict[tuple[str, str], int] = {}
    for s in now:
        if s.name == P + "breaker_state":
            k = (s.label("backend"), s.label("replica"))
            out[k] = max(out.get(k, 0), int(s.value))
    return out


def _engines(now: Iterable[Sample], delta: list[Sample], dt: float | None) -> list[EngineRow]:
    gauges: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for s in now:
        short = s.name.removeprefix(P)
        if short in ("engine_requests_running", "engine_requests_waiting", "kv_cache_usage_ratio"):
            gauges[(s.label("backend"), s.label("replica"))][short] = s.value
    counts: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in delta:
        short = s.name.removeprefix(P)
        if short in ("prefix_cache_hits_total", "prefix_cache_queries_total", "engine_requests_total"):
            counts[(s.label("backend"), s.label("replica"))][short] += s.value
    breakers = _breakers(now)
    rows = []
    for key in sorted(gauges):
        g, c = gauges[key], counts.get(key, {})
        queries = c.get("prefix_cache_queries_total", 0.0)
        hit_rate = c.get("prefix_cache_hits_total", 0.0) / queries if queries > 0 else None
        rows.append(
            EngineRow(
                backend=key[0],
                replica=key[1],
                running=int(g.get("engine_requests_running", 0)),
                waiting=int(g.get("engine_requests_waiting", 0)),
                kv_usage=g.get("kv_cache_usage_ratio", 0.0),
                hit_rate=hit_rate,
                breaker=BREAKER_NAMES.get(breakers.get(key, 0), "?"),
                rps=_rate(c.get("engine_requests_total", 0.0), dt),
            )
        )
    return rows


def _backends(now: Iterable[Sample], delta: list[Sample], dt: float | None) -> list[BackendRow]:
    """Every backend the gateways hold a breaker for or measured a first token from (providers
    included, which have no engine rows)."""
    breakers = _breakers(now)
    ttft: dict[str, list[Sample]] = defaultdict(list)
    for s in delta:
        if s.name.startswith(P + "ttft_seconds"):
            ttft[s.label("backend")].append(s)
    rows = []
    for backend in sorted({b for b, _ in breakers} | set(ttft)):
        series = ttft.get(backend, [])
        first_tokens = sum(s.value for s in series if s.name == P + "ttft_seconds_count")
        p50, p99 = _ttft(series)
        state = BREAKER_NAMES.get(breakers.get((backend, ""), 0), "?")
        rows.append(BackendRow(backend, state, _rate(first_tokens, dt), p50, p99))
    return rows
