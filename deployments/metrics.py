"""Prometheus metrics through Ray's metrics agent, so they aggregate across replicas and nodes.

Ray exports them with a ``ray_`` prefix (``ray_llmc_ttft_seconds`` …) on each node's metrics port
(``server.metrics_port``, 8080 by default; ``cluster serve`` prints it). Names follow vLLM's and
Prometheus' conventions: counters end in ``_total``, latencies are histograms in seconds, shares are
``_ratio``. Names and tags are the contract with the Grafana dashboard in ``k8s/monitoring`` (a live
test checks every panel's metric is exported) and with ``cluster status``.

Ray's own ``ray.util.metrics``, not ``ray.serve.metrics``: Serve's variant adds (and reserves) the
``replica`` tag only when the module is first imported inside a replica, so whether a metric could
be created depended on import order (the engine replicas' metrics used to fail to register).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from cluster.wire.protocol import BackendStats, Usage

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60, 120]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5]

TTFT = Histogram(
    "llmc_ttft_seconds",
    description="Time from the router receiving a request to its first content token.",
    boundaries=_LATENCY_BUCKETS,
    tag_keys=("surface", "backend"),
)
ITL = Histogram(
    "llmc_itl_seconds",
    description="Mean time between consecutive streamed chunks, one sample per request (never per chunk).",
    boundaries=_ITL_BUCKETS,
    tag_keys=("surface",),
)
LATENCY = Histogram(
    "llmc_e2e_request_latency_seconds",
    description="End-to-end latency at the gateway, from receiving a request to its last byte.",
    boundaries=_LATENCY_BUCKETS,
    tag_keys=("surface", "outcome"),
)
TOKENS = Counter(
    "llmc_tokens_total",
    description=(
        "Tokens processed, by kind (prompt, completion, cached, cache_write) and outcome: completed "
        "(the usage a client was given) or cancelled (a provider stream that ended without usage: a "
        "client cancel, a lost hedge, a stall; the provider bills it, counted as sent and received) "
        "or migrated (a continuation's prompt, prefilled again after a stream broke mid-answer)."
    ),
    tag_keys=("surface", "backend", "kind", "outcome"),
)
ENDINGS = Counter(
    "llmc_requests_ended_total",
    description="Requests ended at the router, by outcome (completed, errored, cancelled).",
    tag_keys=("surface", "outcome"),
)
ADMISSIONS = Counter(
    "llmc_admissions_total", description="Requests admitted, by surface.", tag_keys=("surface",)
)
REJECTIONS = Counter(
    "llmc_rejections_total",
    description="Requests refused by admission (429 rate_limit_exceeded, 503 overloaded), by surface.",
    tag_keys=("surface", "code"),
)
REFUSAL_TIME = Histogram(
    "llmc_refusal_seconds",
    description=(
        "Time a refused request (429 or 503 from admission or a tenant budget) spent in the gateway, "
        "from its handler's start to the refusal handed to the connection: the promise is a few ms."
    ),
    boundaries=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5],
    tag_keys=("surface",),
)
QUEUE_WAIT = Histogram(
    "llmc_queue_wait_seconds",
    description="Time an admitted request waited for a slot.",
    boundaries=_LATENCY_BUCKETS,
    tag_keys=("surface",),
)
ROUTING = Counter(
    "llmc_routing_decisions_total",
    description="Replica choices by reason (session, prefix, new_prefix, load, saturated, or a baseline).",
    tag_keys=("backend", "reason"),
)
ATTEMPTS = Counter(
    "llmc_extra_attempts_total",
    description="Upstream attempts beyond each request's first (retries and hedges): the extra load.",
    tag_keys=("backend", "kind"),
)
HEDGES = Counter(
    "llmc_hedges_total",
    description="Hedged attempts: sent, won (produced the first token), cancelled (lost the race).",
    tag_keys=("backend", "outcome"),
)
MIGRATIONS = Counter(
    "llmc_migrations_total",
    description=(
        "Self-hosted streams that broke after their first token, by reason (death, drain, stall, "
        "error) and outcome: migrated (continued on another replica), failed (no replica took the "
        "continuation) or why it was refused (budget, max_per_request, provider, deadline, ...)."
    ),
    tag_keys=("backend", "reason", "outcome"),
)
MIGRATION_PREFILL = Counter(
    "llmc_migration_prefill_tokens_total",
    description="Continuations' prompt tokens (the client's prompt plus the tokens sent), prefilled again.",
    tag_keys=("backend",),
)
MIGRATION_SEAM = Histogram(
    "llmc_migration_seam_seconds",
    description="From the last token before a stream broke to the continuation's first (seam TTFT).",
    boundaries=_LATENCY_BUCKETS,
    tag_keys=("backend",),
)
BREAKER_STATE = Gauge(
    "llmc_breaker_state",
    description='Circuit breaker per backend (replica "") and replica: 0 closed, 1 open, 2 half-open.',
    tag_keys=("backend", "replica"),
)
CONTEXT_REROUTES = Counter(
    "llmc_context_reroutes_total",
    description="Requests sent to a bigger-window model because they did not fit (from, to).",
    tag_keys=("from_model", "to_model"),
)
CONTEXT_REJECTIONS = Counter(
    "llmc_context_rejections_total",
    description="Requests refused with context_length_exceeded, by model.",
    tag_keys=("model",),
)
PREFIX_HIT_RATE = Gauge(
    "llmc_prefix_cache_hit_rate",
    description="Engine prefix-cache hit rate per backend (hits / queries, tokens, since start).",
    tag_keys=("backend",),
)
NO_CAPACITY = Counter(
    "llmc_no_capacity_total",
    description="Requests refused 503 no_capacity: no replica of the backend could take them in time.",
    tag_keys=("backend",),
)
UNREACHABLE = Counter(
    "llmc_replica_unreachable_total",
    description="Engine replicas skipped after a refused or lost connection or a dead engine (re-picked).",
    tag_keys=("backend", "why"),
)
FAILOVERS = Counter(
    "llmc_failovers_total",
    description="Attempts abandoned before the first token for the next candidate.",
    tag_keys=("backend", "code"),
)
COST = Counter(
    "llmc_cost_usd_total",
    description="Estimated spend in USD from configured per-token prices, by outcome (as llmc_tokens_total).",
    tag_keys=("surface", "backend", "outcome"),
)
PREFIX_QUERIES = Counter(
    "llmc_prefix_cache_queries_total",
    description="Prompt tokens looked up in the engine's prefix cache (vLLM's counter, per replica).",
    tag_keys=("backend", "replica"),
)
PREFIX_HITS = Counter(
    "llmc_prefix_cache_hits_total",
    description="Prompt tokens found in the engine's prefix cache (vLLM's counter, per replica).",
    tag_keys=("backend", "replica"),
)
ENGINE_REQUESTS = Counter(
    "llmc_engine_requests_total",
    description="Requests an engine replica started (its own count: hedges and retries included).",
    tag_keys=("backend", "replica"),
)
KV_USAGE = Gauge(
    "llmc_kv_cache_usage_ratio",
    description="Share of the replica's KV cache in use (0..1).",
    tag_keys=("backend", "replica"),
)
RUNNING = Gauge(
    "llmc_engine_requests_running",
    description="Requests running in the engine.",
    tag_keys=("backend", "replica"),
)
WAITING = Gauge(
    "llmc_engine_requests_waiting",
    description="Requests waiting in the engine.",
    tag_keys=("backend", "replica"),
)
GATEWAY_IN_FLIGHT = Gauge(
    "llmc_gateway_requests_in_flight",
    description="Requests admitted and not yet ended, per gateway replica.",
    tag_keys=("gateway",),
)
GATEWAY_WAITING = Gauge(
    "llmc_gateway_requests_waiting",
    description="Requests queued for admission, per gateway replica.",
    tag_keys=("gateway",),
)

GATEWAY_LOOP_LAG = Gauge(
    "llmc_gateway_loop_lag_p99_seconds",
    description="p99 of how late the gateway replica's event loop ran over the last minute "
    "(every request and relayed chunk of that replica waits this long on top of its work).",
    tag_keys=("gateway",),
)


def record_breakers(rows: list[tuple[str, str, int]]) -> None:
    for backend, replica, state in rows:
        BREAKER_STATE.set(state, tags={"backend": backend, "replica": replica})


def record_gateway(gateway: str, in_flight: int, waiting: int, loop_lag_p99_ms: float | None = None) -> None:
    GATEWAY_IN_FLIGHT.set(in_flight, tags={"gateway": gateway})
    GATEWAY_WAITING.set(waiting, tags={"gateway": gateway})
    if loop_lag_p99_ms is not None:
        GATEWAY_LOOP_LAG.set(loop_lag_p99_ms / 1000, tags={"gateway": gateway})


def record_usage(surface: str, backend: str, usage: Usage, outcome: str = "completed") -> None:
    tags = {"surface": surface, "backend": backend, "outcome": outcome}
    for kind, n in (
        ("prompt", usage.prompt_tokens),
        ("completion", usage.completion_tokens),
        ("cached", usage.cached_tokens),
        ("cache_write", usage.cache_creation_tokens),
    ):
        if n > 0:  # Ray's counters refuse increments of zero
            TOKENS.inc(n, tags={**tags, "kind": kind})


class EngineReporter:
    """One engine replica's counters and gauges, recorded once a second from its own process.

    The engine keeps running totals; Prometheus counters take increments, so this remembers what it
    last reported. The hit-rate gauge is one series per replica process (Ray labels each), which the
    dashboard averages by backend; the exact rate is ``rate(hits_total) / rate(queries_total)``.
    """

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._last: dict[str, int] = {}

    def record(self, s: BackendStats) -> None:
        tags = {"backend": s.backend, "replica": self.replica}
        if s.prefix_cache_queries:
            PREFIX_HIT_RATE.set(s.prefix_cache_hits / s.prefix_cache_queries, tags={"backend": s.backend})
        for counter, key, total in (
            (PREFIX_QUERIES, "queries", s.prefix_cache_queries),
            (PREFIX_HITS, "hits", s.prefix_cache_hits),
            (ENGINE_REQUESTS, "requests", s.requests_started),
        ):
            step = total - self._last.get(key, 0)
            if step > 0:  # Ray's counters refuse increments of zero
                counter.inc(step, tags=tags)
            self._last[key] = total
        KV_USAGE.set(s.kv_usage, tags=tags)
        RUNNING.set(s.running, tags=tags)
        WAITING.set(s.waiting, tags=tags)
