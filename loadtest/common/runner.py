"""The benchmark runner's engine: send a fixed open-loop schedule with an async httpx client, time
every streamed request as a client sees it, summarize per surface, and read the cluster's own
Prometheus metrics before and after.

* :func:`run_schedule` — one task per request, started at its arrival offset (open loop: a slow
  server does not slow the arrivals down; a client-side cap on requests in flight bounds this
  process, and the time a request waited for it is reported as ``client_lag``).
* :func:`stream_one` — one SSE request: TTFT (first content token), every inter-token gap, output
  tokens (the usage chunk's count when present), end to end, errors by type (HTTP status + the
  OpenAI error code, or an error event inside the stream, or the transport exception), and a
  client cancel after ``cancel_after_s`` (Tab users keep typing).
* :func:`summarize` — per surface and overall: quantiles, throughput, goodput against each
  surface's TTFT objective.
* :func:`parse_prometheus` / :func:`metrics_delta` — the ``ray_llmc_*`` series from Ray's metrics
  port: counters and histograms as differences over the run, gauges as their last value.

Nothing here starts a cluster (see :mod:`loadtest.benchmarks.cli_bench`).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from cluster.observability import prometheus
from loadtest.common.client import EventStream
from loadtest.common.procs import quiet_collector
from loadtest.common.request_spec import RequestSpec
from loadtest.common.stats import quantile


@dataclass
class Result:
    """What the client saw for one request (times in seconds)."""

    surface: str
    session_id: str
    turn: int
    scheduled_s: float
    sent_s: float = 0.0  # offset from the run's start
    status: str = "ok"  # ok | cancelled | error
    error: str | None = None  # e.g. http_429:rate_limit_exceeded, stream:stream_interrupted, ReadTimeout
    ttft_s: float | None = None
    e2e_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str | None = None

    @property
    def decode_tok_s(self) -> float | None:
        """Output tokens per second after the first one (the user's reading speed)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        span = self.e2e_s - self.ttft_s
        return (self.output_tokens - 1) / span if span > 0 else None


def _error_code(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        return str(err.get("code") or err.get("type") or "error")
    return "error"


async def stream_one(
    client: httpx.AsyncClient, base_url: str, model: str, spec: RequestSpec, t0: float
) -> Result:
    """Send one streaming request now and time it; never raises (failures become ``Result.error``)."""
    res = Result(spec.surface, spec.session_id, spec.turn, spec.arrival_s)
    start = time.perf_counter()
    res.sent_s = start - t0
    last = start
    try:
        async with asyncio.timeout(spec.cancel_after_s):
            async with client.stream(
                "POST", base_url + spec.path, json=spec.body(model), headers=spec.headers()
            ) as r:
                res.replica = r.headers.get("x-llmc-replica")
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        code = _error_code(json.loads(raw))
                    except ValueError:
                        code = "non_json"
                    res.status, res.error = "error", f"http_{r.status_code}:{code}"
                    res.e2e_s = time.perf_counter() - start
                    return res
                async for data in EventStream().aiter(r):
                    obj = json.loads(data)
                    if "error" in obj:
                        res.status, res.error = "error", f"stream:{_error_code(obj)}"
                        break
                    now = time.perf_counter()
                    for ch in obj.get("choices") or ():
                        text = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                        if text:
                            if res.ttft_s is None:
                                res.ttft_s = now - start
                            else:
                                res.gaps_s.append(now - last)
                            last = now
                            res.output_tokens += 1
                    usage = obj.get("usage")
                    if usage:
                        res.output_tokens = int(usage.get("completion_tokens") or res.output_tokens)
                        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = int(details.get("cached_tokens") or 0)
    except TimeoutError:
        res.status = "cancelled"  # the client gave up on purpose (spec.cancel_after_s)
    except (httpx.HTTPError, ValueError) as exc:
        res.status, res.error = "error", type(exc).__name__
    res.e2e_s = time.perf_counter() - start
    return res


Progress = Callable[[dict[str, Any]], None]


async def run_schedule(
    base_url: str,
    model: str,
    specs: list[RequestSpec],
    *,
    max_in_flight: int = 256,
    timeout_s: float = 120.0,
    progress: Progress | None = None,
    progress_every_s: float = 0.5,
) -> tuple[list[Result], float]:
    """Send every spec at its offset ``t``; returns the results (schedule order) and the wall time."""
    quiet_collector()  # no collector pause of ours inside the measurement
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    sem = asyncio.Semaphore(max_in_flight)
    done: list[Result] = []
    state = {"in_flight": 0}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> Result:
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                state["in_flight"] += 1
                try:
                    res = await stream_one(client, base_url, model, spec, t0)
                finally:
                    state["in_flight"] -= 1
            done.append(res)
            return res

        tasks = [asyncio.create_task(one(s)) for s in specs]
        ticker = None
        if progress is not None:

            async def tick() -> None:
                while True:
                    progress(_progress_state(done, len(specs), state["in_flight"], time.perf_counter() - t0))
                    await asyncio.sleep(progress_every_s)

            ticker = asyncio.create_task(tick())
        try:
            results = await asyncio.gather(*tasks)
        finally:
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
        wall = time.perf_counter() - t0
        if progress is not None:
            progress(_progress_state(done, len(specs), 0, wall))
    return list(results), wall


def _progress_state(done: list[Result], total: int, in_flight: int, elapsed: float) -> dict[str, Any]:
    ttfts = sorted(r.ttft_s for r in done[-200:] if r.ttft_s is not None)
    return {
        "elapsed_s": elapsed,
        "done": len(done),
        "total": total,
        "in_flight": in_flight,
        "errors": sum(r.status == "error" for r in done),
        "ttft_p50_ms": 1000 * quantile(ttfts, 0.5) if ttfts else None,
    }


# --- statistics -------------------------------------------------------------------------------


def _dist_ms(xs: list[float]) -> dict[str, float | None]:
    s = sorted(xs)
    if not s:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "n": len(s),
        "p50": round(1000 * quantile(s, 0.5), 2),
        "p90": round(1000 * quantile(s, 0.9), 2),
        "p99": round(1000 * quantile(s, 0.99), 2),
        "mean": round(1000 * sum(s) / len(s), 2),
    }


def summarize_group(results: list[Result], wall_s: float, slo_ms: float | None) -> dict[str, Any]:
    """Client-side figures for a group of requests (one surface, or all)."""
    ok = [r for r in results if r.status == "ok"]
    errors = Counter(r.error or "error" for r in results if r.status == "error")
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    gaps = [g for r in results for g in r.gaps_s]
    out_tokens = sum(r.output_tokens for r in results)
    decode = sorted(x for r in ok if (x := r.decode_tok_s) is not None)
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "cancelled": sum(r.status == "cancelled" for r in results),
        "errors": sum(errors.values()),
        "errors_by_type": dict(sorted(errors.items())),
        "ttft_ms": _dist_ms(ttfts),
        "itl_ms": _dist_ms(gaps),
        "e2e_ms": _dist_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "decode_tok_s_p50": round(quantile(decode, 0.5), 1) if decode else None,
        "requests_s": round(len(ok) / wall_s, 2) if wall_s > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "cached_tokens": sum(r.cached_tokens for r in results),
    }
    if slo_ms is not None:
        summary.update(goodput(results, slo_ms, wall_s))
    return summary


def goodput(results: list[Result], slo_ms: float, wall_s: float) -> dict[str, Any]:
    """Share of requests that got their first token within the TTFT objective without an error.

    The denominator leaves out requests the client itself abandoned before the objective had
    passed without a token (nobody was waiting any more), so frequent Tab cancels do not count
    against the server.
    """
    slo = slo_ms / 1000
    judged = [
        r for r in results if not (r.status == "cancelled" and r.ttft_s is None and (r.e2e_s or 0) < slo)
    ]
    good = [r for r in judged if r.status != "error" and r.ttft_s is not None and r.ttft_s <= slo]
    return {
        "slo_ttft_ms": slo_ms,
        "good": len(good),
        "judged": len(judged),
        "goodput": round(len(good) / len(judged), 4) if judged else None,
        "good_requests_s": round(len(good) / wall_s, 2) if wall_s > 0 else None,
        "good_output_tok_s": round(sum(r.output_tokens for r in good) / wall_s, 1) if wall_s > 0 else None,
    }


def summarize(results: list[Result], wall_s: float, slos_ms: dict[str, float]) -> dict[str, Any]:
    by: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by[r.surface].append(r)
    lag = sorted(max(0.0, r.sent_s - r.scheduled_s) for r in results)
    overall = summarize_group(results, wall_s, None)
    per = [goodput(rs, slos_ms.get(s, 1000.0), wall_s) for s, rs in by.items()]
    judged = sum(g["judged"] for g in per)
    overall["goodput"] = round(sum(g["good"] for g in per) / judged, 4) if judged else None
    overall["client_lag_ms_p99"] = round(1000 * quantile(lag, 0.99), 2) if lag else None
    return {
        "wall_s": round(wall_s, 3),
        "overall": overall,
        "surfaces": {s: summarize_group(rs, wall_s, slos_ms.get(s, 1000.0)) for s, rs in sorted(by.items())},
    }


def result_rows(results: list[Result]) -> list[dict[str, Any]]:
    """Per-request rows for the JSON report (gaps reduced to count/mean/max to keep it small)."""
    rows = []
    for r in results:
        d = asdict(r)
        gaps = d.pop("gaps_s")
        d["itl_mean_ms"] = round(1000 * sum(gaps) / len(gaps), 3) if gaps else None
        d["itl_max_ms"] = round(1000 * max(gaps), 3) if gaps else None
        rows.append(d)
    return rows


# --- Prometheus -----------------------------------------------------------------------------------

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
DROP_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "JobId", "instance"}


def parse_prometheus(text: str, prefix: str = "ray_llmc_") -> Series:
    """Samples of the series whose name starts with ``prefix``: (name, sorted labels) → value.

    Ray's per-process labels (worker id, node address …) are dropped and equal series summed, so
    a counter reads as the cluster's total.
    """
    out: Series = defaultdict(float)
    for s in prometheus.parse(text, prefix):
        lab = tuple(sorted((k, v) for k, v in s.labels.items() if k not in DROP_LABELS))
        out[(s.name, lab)] += s.value
    return dict(out)


def scrape(url: str, timeout_s: float = 5.0) -> Series:
    """GET a Prometheus endpoint (Ray's metrics port) and parse it; empty on any failure."""
    try:
        r = httpx.get(url, timeout=timeout_s, trust_env=False)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"[bench] metrics scrape failed ({url}): {exc}", file=sys.stderr)
        return {}
    return parse_prometheus(r.text)


def _base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def metrics_delta(before: Series, after: Series) -> Series:
    """Counters and histogram parts as increases over the run; gauges as their value after."""
    out: Series = {}
    for key, v in after.items():
        name = key[0]
        cumulative = name.endswith(("_bucket", "_sum", "_count", "_total"))
        out[key] = v - before.get(key, 0.0) if cumulative else v
    return out


def histogram_quantiles(
    delta: Series, metric: str, by: str | None = None, qs: tuple[float, ...] = (0.5, 0.99)
) -> dict[str, dict[str, float | None]]:
    """Quantiles (ms) of a histogram over the run, grouped by one label (or all together)."""
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for (name, labels), v in delta.items():
        if name != f"{metric}_bucket":
            continue
        lab = dict(labels)
        le = lab.get("le")
        if le is None:
            continue
        group = lab.get(by, "") if by else "all"
        buckets[group][math.inf if le in ("+Inf", "inf") else float(le)] += v
    out: dict[str, dict[str, float | None]] = {}
    for group, b in sorted(buckets.items()):
        edges = sorted(b)
        total = b[edges[-1]] if edges else 0.0
        row: dict[str, float | None] = {"count": total}
        for q in qs:
            row[f"p{round(q * 100)}"] = _bucket_quantile(edges, b, total, q)
        out[group] = row
    return out


def _bucket_quantile(edges: list[float], b: dict[float, float], total: float, q: float) -> float | None:
    v = prometheus.quantile(q, b) if total > 0 else None
    return None if v is None else round(1000 * v, 2)


def sum_by(delta: Series, metric: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (name, labels), v in delta.items():
        if name == metric:
            out[dict(labels).get(label, "")] += v
    return dict(sorted(out.items()))


def server_summary(before: Series, after: Series) -> dict[str, Any]:
    """The cluster's view of the run, from the ``ray_llmc_*`` series."""
    if not after:
        return {"available": False}
    d = metrics_delta(before, after)
    hits = sum(v for (n, _), v in d.items() if n == "ray_llmc_prefix_cache_hits_total")
    dq = sum(v for (n, _), v in d.items() if n == "ray_llmc_prefix_cache_queries_total")
    return {
        "available": True,
        "ttft_ms_by_surface": histogram_quantiles(d, "ray_llmc_ttft_seconds", "surface"),
        "itl_ms_by_surface": histogram_quantiles(d, "ray_llmc_itl_seconds", "surface"),
        "queue_wait_ms_by_surface": histogram_quantiles(d, "ray_llmc_queue_wait_seconds", "surface"),
        "tokens_by_kind": sum_by(d, "ray_llmc_tokens_total", "kind"),
        "endings_by_outcome": sum_by(d, "ray_llmc_requests_ended_total", "outcome"),
        "rejections_by_code": sum_by(d, "ray_llmc_rejections_total", "code"),
        "failovers_by_backend": sum_by(d, "ray_llmc_failovers_total", "backend"),
        "routing_by_reason": sum_by(d, "ray_llmc_routing_decisions_total", "reason"),
        # The engines' prefix-cache counters: the run's hit rate is their increases' ratio.
        "prefix_cache_hit_rate": round(hits / dq, 4) if dq > 0 else None,
    }
