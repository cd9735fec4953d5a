"""A noisy neighbour on a shared pool, wall clock (issue 16 item 4): tenant ``a`` runs away on Agent at
10x its request budget while tenant ``b`` types (Tab) and runs a light agent of its own, all on the
same replicas, behind two gateway replicas; without a budget for ``a``, with one, and with one whose
bucket holds only a few seconds of it, in one run.

    python -m loadtest.benchmarks.bench_noisy_neighbour            # ~4.5 minutes
    python -m loadtest.benchmarks.bench_noisy_neighbour --variants on_short_burst --capacity 11.5 \
        --out /tmp/x.json                                          # a probe of one variant (~1.5 minutes)

The cluster is :func:`loadtest.benchmarks.bench_overload.overload_config` with ``--pools shared`` at speedup 1
(three simulated H100 replicas of Llama-3.1-8B at their own speed that Tab and Agent share, the
product limits of :data:`loadtest.benchmarks.bench_overload.SURFACE_LIMITS`, the engine's priority policy and
the SLO guard on, as the product ships) with the product's two gateway replicas, so that a tenant's
budget is counted once across both (:mod:`deployments.budgets.tenant_budget`). Tenants (``x-tenant``):

* ``b``: no budget; Tab at ``--tab-rate`` and Agent at ``--b-agent-share`` of Agent's capacity;
* ``a``: Agent at 10x its budget (``--flood-x``). Variant ``on``: an RPM budget of ``--a-share`` of
  Agent's capacity whose bucket holds a minute's requests (``TenantConfig.burst_s`` 60, the
  default); ``on_short_burst``: the same budget, its bucket ``--a-burst-s`` (5) seconds' of it;
  ``off``: no budget, the same flood.

Per variant: deploy, warm up, ``b`` alone for ``--alone-s`` (its own baseline), then ``b`` with ``a``'s
flood for ``--flood-s``. Agent's capacity is measured once, in the first variant, closed loop at its
concurrency limit, and used for both. The issue's goal: ``b``'s Tab p99 TTFT with the flood at most
1.2x its p99 alone (``b_tab_p99_ratio``), and ``a`` answered 429 with ``Retry-After``. Keys per phase:
``tenants.<t>.<surface>`` (the client's view, :func:`loadtest.benchmarks.bench_overload.per_surface`),
``tenants.b.agent.goodput_tok_s`` (output tokens/s of ``b``'s Agent requests answered 200 within
Agent's 3 s objective), ``a_refusals`` (by reason: its budget, its queued place taken by ``b``
(``pushed_out``, :mod:`cluster.policy.fair_queue`), admission), ``a_admitted_allowance`` (what the
budget lets through in the phase: a full bucket of one minute's requests plus its refill),
``reject_p99_ms`` (client-side, every 429/503) and ``reject_at_once_p99_ms`` (without the waiters
pushed out, which waited before their 429), ``by_slice`` (``b``'s Tab p99 and ``a``'s admitted
requests by 10 s of the phase), ``b_tab_slowest`` (``b``'s three slowest Tab requests, which set
its p99 of ~110: when sent, where the gateway's Server-Timing says their time went, the Agent
requests sent in the second before each), ``floor_answer_ms`` (:mod:`loadtest.common.serve_floor`), and
from every gateway replica's status: loop lag, refusal time inside, admission counters summed.

``--a-share`` 0.1 by default: ``a``'s flood is then about Agent's capacity, its budget's bucket (a
minute's worth, full at the start, in ``on``) is empty after about 7 s of it, and the budget binds
for the rest of the phase; with a larger share, admission's own limits bind first and the variants
differ little. Runs 1-3 (``on`` and ``off`` only) found ``b``'s Tab tail in those first seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cluster.observability.server_timing import parse_server_timing
from deployments.launcher.local import free_port, gateway_status
from loadtest.benchmarks.bench_overload import APP, closed_loop, overload_config, per_surface, workloads
from loadtest.benchmarks.bench_overload_shared import agent_goodput, with_floor_probe
from loadtest.common.provenance import git_state, provenance, write_report
from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import RESULTS, Result, machine, ms, percentile, replay, warm_up

VARIANTS = ("off", "on", "on_short_burst")
TENANTS = ("a", "b")
GATEWAYS = 2
OUT = RESULTS / "noisy_neighbour.json"
RATIO_GOAL = 1.2  # b's Tab p99 with a's flood / alone (the acceptance)
SLICE_S = 10.0  # the phases' figures by slice (``by_slice``)
# Keep-alive connections the client opens before each phase's clock starts (sim_live.replay). Runs
# 1-4 opened them inside the phase: b's slowest Tab requests were its first, sent in the phase's
# first 100 ms beside every other first request (a check by hand of the timeline, 2026-12-03), and
# they set the whole phase's p99. An editor keeps its connection; the flood's start is measured
# without the load generator's own connection setup.
WARM_CONNECTIONS = 64


def variant_config(
    variant: str, budget_rpm: int | None, burst_s: float = 5.0, gateways: int = GATEWAYS
) -> Any:
    """The shared-pool cluster with tenants ``a`` and ``b`` (no budget). ``a``: no budget (``off``),
    an RPM budget whose bucket holds a minute's requests (``on``, the default ``burst_s``), or one
    that holds ``burst_s`` seconds' (``on_short_burst``)."""
    if variant != "off" and budget_rpm is None:
        raise ValueError(f"variant {variant!r} needs a's budget")
    from cluster.config import parse_config

    raw = overload_config("shared", 1.0).model_dump(mode="json")
    raw["name"] = f"{APP}-nn-{variant}".replace("_", "-")
    raw["server"]["gateway_replicas"] = gateways
    a: dict[str, Any] = {"name": "a"}
    if variant != "off":
        a["rpm"] = budget_rpm
    if variant == "on_short_burst":
        a["burst_s"] = burst_s
    raw["tenants"] = [a, {"name": "b"}]
    return parse_config(raw)


def tenant_load(rates: dict[str, dict[str, float]], window_s: float, seed: int) -> list[RequestSpec]:
    """Each tenant's requests (``rates[tenant][surface]`` per second), its sessions its own."""
    out: list[RequestSpec] = []
    for i, (tenant, by_surface) in enumerate(sorted(rates.items())):
        for s in workloads({k: v for k, v in by_surface.items() if v > 0}, window_s, seed + 10 * i):
            out.append(replace(s, tenant=tenant, session_id=f"{tenant}-{s.session_id}"))
    return sorted(out, key=lambda s: s.arrival_s)


def allowance(budget_rpm: int | None, window_s: float, burst_s: float | None = 60.0) -> int | None:
    """The most requests a full bucket (``burst_s`` seconds of the budget, at least one request)
    lets through in ``window_s``."""
    if budget_rpm is None:
        return None
    rate = budget_rpm / 60.0
    return math.floor(max(1.0, rate * (burst_s or 60.0)) + rate * window_s)


def refusal_reason(r: Result) -> str:
    """Why ``r`` was refused: its tenant's budget (at once), its place in a full queue taken by a
    tenant with a smaller share (after a wait: :mod:`cluster.policy.fair_queue`), or admission at
    once (a full queue, a predicted wait, the guard, saturation)."""
    text = r.error or ""
    if "over its budget" in text:
        return "budget"
    return "pushed_out" if "smaller share" in text else "admission"


def tenant_report(
    results: Sequence[Result], tenants: Sequence[str | None], cfg: Any, window_s: float
) -> dict[str, Any]:
    """The client's view per tenant and surface; ``b``'s Agent goodput (200 within Agent's SLO)."""
    out: dict[str, Any] = {}
    for t in TENANTS:
        mine = [r for r, tt in zip(results, tenants, strict=True) if tt == t]
        if mine:
            out[t] = per_surface(mine, cfg, 5.0, window_s, 1.0)
            out[t]["agent"]["goodput_tok_s"] = agent_goodput(mine, cfg, window_s)
    return out


def phase_figures(
    results: Sequence[Result], specs: Sequence[RequestSpec], cfg: Any, window_s: float
) -> dict[str, Any]:
    """A phase's figures from the client's results (``specs`` in the same order)."""
    tenants = [s.tenant for s in specs]
    rep: dict[str, Any] = {"tenants": tenant_report(results, tenants, cfg, window_s)}
    refused = [r for r in results if r.status in (429, 503) and r.latency_s is not None]
    rep["reject_p99_ms"] = ms(percentile([r.latency_s for r in refused], 99))
    at_once = [r.latency_s for r in refused if refusal_reason(r) != "pushed_out"]
    rep["reject_at_once_p99_ms"] = ms(percentile(at_once, 99))  # without the waiters pushed out
    rep["rejects"] = len(refused)
    a_refused = [r for r, t in zip(results, tenants, strict=True) if t == "a" and r.status in (429, 503)]
    reasons: dict[str, int] = {}
    for r in a_refused:
        reasons[refusal_reason(r)] = reasons.get(refusal_reason(r), 0) + 1
    rep["a_refusals"] = reasons
    rep["a_refusals_without_retry_after"] = sum(1 for r in a_refused if not r.retry_after)
    rep["hung"] = sum(r.hung for r in results)
    rep["by_slice"] = slices(results, tenants, window_s)
    rep["b_tab_slowest"] = slowest_tab(results, specs)
    return rep


def slowest_tab(results: Sequence[Result], specs: Sequence[RequestSpec], n: int = 3) -> list[dict[str, Any]]:
    """``b``'s ``n`` slowest Tab requests (they set its p99): when each was sent, its TTFT at the
    client and where the gateway says it went (Server-Timing: prep, queue, upstream, ttft; the rest
    of the client's TTFT is outside the gateway's handler), its replica, and the Agent requests of
    each tenant sent in the second before it (what it may have queued behind)."""
    tab = [
        r
        for r, s in zip(results, specs, strict=True)
        if s.tenant == "b" and r.surface == "tab" and r.status == 200 and r.ttft_s is not None
    ]
    out = []
    for r in sorted(tab, key=lambda r: r.ttft_s or 0.0, reverse=True)[:n]:
        before = [
            s.tenant
            for x, s in zip(results, specs, strict=True)
            if s.surface == "agent" and r.sent_s - 1.0 <= x.sent_s <= r.sent_s
        ]
        out.append(
            {
                "sent_s": round(r.sent_s, 3),
                "ttft_ms": ms(r.ttft_s),
                "server_timing_ms": parse_server_timing(r.timing),
                "replica": r.replica,
                "agent_sent_in_1s_before": {t: before.count(t) for t in TENANTS},
            }
        )
    return out


def slices(
    results: Sequence[Result], tenants: Sequence[str | None], window_s: float, slice_s: float = SLICE_S
) -> dict[str, list[Any]]:
    """By ``slice_s`` of the phase (by send time): ``b``'s Tab p99 TTFT (ms) and ``a``'s requests
    admitted, to tell the flood's start (``a``'s full bucket: a minute's requests at once) from
    the rest."""
    n = max(1, math.ceil(window_s / slice_s))
    tab: list[list[float]] = [[] for _ in range(n)]
    admitted = [0] * n
    for r, t in zip(results, tenants, strict=True):
        k = min(n - 1, int(r.sent_s // slice_s))
        if t == "b" and r.surface == "tab" and r.status == 200 and r.ttft_s is not None:
            tab[k].append(r.ttft_s)
        elif t == "a" and r.status == 200:
            admitted[k] += 1
    return {"b_tab_p99_ms": [ms(percentile(x, 99)) for x in tab], "a_admitted": admitted}


def gateway_statuses(app_url: str, replicas: int, tries: int = 40) -> dict[str, dict[str, Any]]:
    """Each gateway replica's status by replica id (HAProxy picks one per call: ask until each
    answered, at most ``tries`` times)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        s = gateway_status(app_url)
        seen[s.get("replica", "?")] = s
        if len(seen) >= replicas:
            break
    return seen


def admission_checks(before: dict[str, dict], after: dict[str, dict]) -> dict[str, Any]:
    """Every gateway replica's admission counters over the phase, summed; the phase balanced when
    every admitted request ended and nothing is in flight or waiting on any replica."""
    delta: dict[str, int] = {}
    for rid, s in after.items():
        a0 = before.get(rid, {}).get("admission", {})
        for k, v in s.get("admission", {}).items():
            if type(v) is int:
                delta[k] = delta.get(k, 0) + v - a0.get(k, 0)
    ended = sum(delta.get(k, 0) for k in ("completed", "errored", "cancelled"))
    idle = all(s["admission"]["in_flight"] == 0 and s["admission"]["waiting"] == 0 for s in after.values())
    return {
        "gateways_seen": len(after),
        "admission_delta": delta,
        "checks": {
            "admitted_equals_ended": delta.get("admitted", 0) == ended,
            "nothing_in_flight_or_waiting_after": idle,
            "counters_balanced": all(bool(s["admission"].get("balanced")) for s in after.values()),
        },
    }


def run_phase(app_url: str, cfg: Any, rates: dict[str, dict[str, float]], window_s: float, seed: int) -> dict:
    specs = tenant_load(rates, window_s, seed)
    before = gateway_statuses(app_url, cfg.server.gateway_replicas)
    timeout_s = max(s.request_timeout_s for s in cfg.surfaces) + 5.0
    lag: list[float] = []
    floor: list[float] = []
    work = replay(
        app_url + "/v1/chat/completions",
        specs,
        timeout_s=timeout_s,
        closed_loop=False,
        model=cfg.models[0].name,
        lag=lag,
        warm_connections=WARM_CONNECTIONS,
    )
    results, _ = asyncio.run(with_floor_probe(work, app_url.rsplit("/", 1)[0] + "/floor/ping", floor))
    time.sleep(1.0)  # the last releases settle
    after = gateway_statuses(app_url, cfg.server.gateway_replicas)
    rep = phase_figures(results, specs, cfg, window_s)
    rep["offered_per_s"] = rates
    rep["warm_connections"] = WARM_CONNECTIONS
    rep.update(admission_checks(before, after))
    rep["client_loop_lag_ms"] = {f"p{q}": ms(percentile(lag, q)) for q in (50, 99)}
    rep["floor_answer_ms"] = {"n": len(floor), **{f"p{q}_ms": ms(percentile(floor, q)) for q in (50, 99)}}
    rep["gateways"] = {
        rid: {
            "loop_lag_ms_last_30s": s.get("loop_lag", {}).get("last_30s"),
            "refusal_ms_last_30s": s.get("refusals", {}).get("last_30s"),
            "guard": s.get("slo_guard", {}),
            "avoided_prefill": avoided_prefill(s) - avoided_prefill(before.get(rid, {})),
        }
        for rid, s in after.items()
    }
    return rep


def avoided_prefill(status: dict[str, Any]) -> int:
    """A gateway replica's decisions so far that kept a request off a replica mid-prefill (its
    surface's ``avoid_prefill_tokens``), over its backends."""
    return sum(v.get("avoided_prefill", 0) for v in status.get("routing", {}).values())


def b_tab_p99_ratio(variant: dict[str, Any]) -> float | None:
    """``b``'s Tab p99 TTFT with ``a``'s flood over its p99 alone, in one variant."""
    try:
        alone = variant["b_alone"]["tenants"]["b"]["tab"]["ttft_p99_wall_ms"]
        flood = variant["a_flood"]["tenants"]["b"]["tab"]["ttft_p99_wall_ms"]
    except KeyError:
        return None
    return round(flood / alone, 3) if alone and flood is not None else None


def measure_capacity(url: str, cfg: Any, calib_s: float, seed: int) -> float:
    limit = cfg.surface("agent").max_concurrency
    specs = workloads({"agent": 10.0}, 30.0, seed + 100)
    calib = asyncio.run(closed_loop(url, specs, {"agent": limit}, calib_s, 60, cfg.models[0].name))
    return sum(1 for r in calib if r.status == 200) / calib_s


def run_variant(variant: str, args: argparse.Namespace, capacity: float | None) -> tuple[dict, float]:
    """One variant as its own app on the run's Ray Serve, deleted afterwards. The first (``off``,
    whose config needs no budget) measures Agent's capacity, which sizes ``a``'s budget and flood."""
    from ray import serve

    from deployments.launcher import local

    if capacity is None and variant != VARIANTS[0]:
        raise ValueError(f"variant {variant!r} needs Agent's capacity, measured by {VARIANTS[0]!r}")
    out: dict[str, Any] = {"load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}
    app_url = f"http://127.0.0.1:{args.port}/{variant}"
    url = app_url + "/v1/chat/completions"
    budget = None if capacity is None else max(1, round(args.a_share * capacity * 60))
    cfg = variant_config(variant, budget, args.a_burst_s)
    served = local.start(cfg, port=args.port, route_prefix=f"/{variant}")
    try:
        if "floor" not in serve.status().applications:  # the first variant's: kept until local.stop()
            from loadtest.common.serve_floor import deploy_floor

            deploy_floor(served, "http://127.0.0.1:9/unused")  # only GETs reach it: answered at once
        asyncio.run(warm_up(url, 4, cfg.models[0].name))
        if capacity is None:
            capacity = measure_capacity(url, cfg, args.calib_s, args.seed)
            out["agent_capacity_measured_here"] = True
            budget = max(1, round(args.a_share * capacity * 60))
        out["a_budget_rpm"] = budget if variant != "off" else None
        out["a_burst_s"] = cfg.tenant("a").burst_s if variant != "off" else None
        b = {"tab": args.tab_rate, "agent": args.b_agent_share * capacity}
        flood = {"agent": args.flood_x * budget / 60.0}
        print(
            f"[{variant}] agent capacity {capacity:.2f} req/s; a floods at {flood['agent']:.1f} req/s",
            flush=True,
        )
        out["b_alone"] = run_phase(app_url, cfg, {"b": b}, args.alone_s, args.seed)
        out["a_flood"] = rep = run_phase(app_url, cfg, {"a": flood, "b": b}, args.flood_s, args.seed + 1)
        rep["a_admitted"] = rep["tenants"]["a"]["agent"]["admitted"]
        rep["a_admitted_allowance"] = allowance(out["a_budget_rpm"], args.flood_s, out["a_burst_s"])
        out["b_tab_p99_ratio"] = b_tab_p99_ratio(out)
        print(
            f"[{variant}] b tab p99 alone {out['b_alone']['tenants']['b']['tab']['ttft_p99_wall_ms']} ms, "
            f"flood {rep['tenants']['b']['tab']['ttft_p99_wall_ms']} ms (x{out['b_tab_p99_ratio']}); "
            f"a admitted {rep['a_admitted']} (allowance {rep['a_admitted_allowance']}), refused "
            f"{rep['a_refusals']}; reject p99 {rep['reject_p99_ms']} ms, hung {rep['hung']}",
            flush=True,
        )
    finally:
        serve.delete(cfg.name)
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out, capacity


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tab-rate", type=float, default=4.0, help="b's Tab requests per second (Poisson)")
    ap.add_argument("--b-agent-share", type=float, default=0.2, help="b's Agent rate / Agent's capacity")
    ap.add_argument("--a-share", type=float, default=0.1, help="a's RPM budget / Agent's capacity (on)")
    ap.add_argument("--flood-x", type=float, default=10.0, help="a's Agent rate / its budget")
    ap.add_argument("--a-burst-s", type=float, default=5.0, help="a's request burst (on_short_burst)")
    ap.add_argument("--calib-s", type=float, default=20.0)
    ap.add_argument("--alone-s", type=float, default=30.0)
    ap.add_argument("--flood-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which, in this order (a probe)")
    ap.add_argument("--capacity", type=float, help="Agent's capacity (req/s), not measured (a probe)")
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        ap.error(f"--variants: {unknown or 'none'} (known: {', '.join(VARIANTS)})")
    if args.variants[0] != VARIANTS[0] and args.capacity is None:
        ap.error(f"--capacity is needed when {VARIANTS[0]!r}, which measures it, does not come first")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
    from deployments.launcher import local

    args.port = args.port or free_port()
    report: dict[str, Any] = {
        "benchmark": "noisy_neighbour",
        "pools": "shared",
        "engine": "sim",
        "speedup": 1.0,
    }
    report.update(gateway_replicas=GATEWAYS, ratio_goal=RATIO_GOAL, machine=machine())
    capacity = args.capacity
    variants: dict[str, Any] = {}
    try:
        for v in args.variants:
            variants[v], capacity = run_variant(v, args, capacity)
    finally:
        local.stop()
    report.update(
        agent_capacity_per_s=round(capacity or 0.0, 3),
        rates={"b_tab": args.tab_rate, "b_agent_share": args.b_agent_share, "a_share": args.a_share},
        flood_x=args.flood_x,
        variants=variants,
        runtime_s=round(time.monotonic() - started, 1),
        provenance=provenance(sys.argv[1:] if argv is None else argv, git, load0, started),
    )
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
