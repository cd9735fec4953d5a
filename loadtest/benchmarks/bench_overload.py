"""Overload: mixed Tab and Agent traffic at 3x the cluster's capacity, on simulated engines.

    python -m loadtest.benchmarks.bench_overload                  # ~3 minutes
    python -m loadtest.benchmarks.bench_overload --pools shared   # Tab and Agent on the same replicas

What must hold (issue 5): admitted Tab requests keep TTFT p99 within their SLO (100 ms); every
rejection is a 429 (or a 503 when the whole cluster is saturated) with ``Retry-After``; nothing hangs
(every request ends by its surface's deadline + ``--margin-s``); and the gateway's admission
accounting balances (admitted = completed + errored + cancelled, nothing left in flight or waiting;
read from the gateway's ``GET /internal/status``, exact because the config, like
``configs/sim-local.yaml``, runs one gateway replica), and agrees with what the client saw (its 200s
= admitted, its 429/503s = rejected).

Cluster (:func:`overload_config`): simulated Llama-3.1-8B on H100s. Surfaces (``SURFACE_LIMITS``, in
simulated time): Tab (priority 0, TTFT SLO 100 ms, a short queue whose 25 ms deadline leaves the
engine most of the SLO) and Agent (priority 2, SLO 3 s, a longer queue). ``--pools dedicated``
(default) gives Tab its own replica and Agent two, by per-surface routes; ``--pools shared`` puts
both surfaces on the same three replicas, where the backend cap is shared and Tab's priority decides
who gets a freed slot — and where an admitted Tab request also waits behind the Agent prompts being
prefilled in the same engine step: admission bounds that wait, it cannot remove it. For Tab and
Agent on the same replicas in wall-clock time, with the engine's priority policy and the SLO guard
on against off, see :mod:`loadtest.benchmarks.bench_overload_shared`.

Time: the engines run ``--speedup`` (0.05) times real time and every time limit of the deployed
config (queue deadlines, request timeouts, the SLO) is divided by it, so the deployed cluster is the
product's cluster in slow motion. The gateway's own latency on this machine (two shared cores, often
dozens of runnable processes from other work: tens to thousands of ms) then weighs 20x less, about
what it weighs next to real GPUs. TTFTs are reported in simulated ms (wall x speedup, ``*_ms``) and
as measured (``*_wall_ms``). ``Retry-After`` values are the deployed (wall) ones.

Capacity is measured, then tripled: a closed-loop phase keeps every surface at its concurrency
limit (as many clients as the limit, back to back) for ``--calib-s``; the completions per second of
each surface are its capacity. The overload phase then sends Poisson arrivals at ``--factor`` (3)
times that rate per surface for ``--duration-s``, open loop. Workloads: Tab requests carry a
repository file prefix + cursor context (~1k tokens, 16 output tokens), Agent requests a long system
prompt + repository context + a growing task history (~3-4k tokens, 64 output tokens); see
:mod:`loadtest.common.workloads`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.launcher.local import free_port
from loadtest.common.procs import quiet_collector
from loadtest.common.provenance import git_state, provenance
from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import (
    MODEL,
    PROFILE,
    RESULTS,
    ROOT,
    Result,
    machine,
    ms,
    percentile,
    replay,
    session,
    stream_chat,
    warm_up,
)
from loadtest.common.workloads import SharedPrefixWorkload, merge, summary

APP = "llmc-overload"
SURFACES = ("tab", "agent")


# The surfaces as a product would set them, in simulated time (see --speedup).
SURFACE_LIMITS: list[dict[str, Any]] = [
    # Tab: completions while typing. A late answer is useless, so a short queue whose deadline
    # leaves the engine most of the 100 ms; the client retries after Retry-After.
    {
        "name": "tab",
        "priority": 0,
        "ttft_slo_ms": 100,
        "max_concurrency": 4,
        "max_queue": 4,
        "queue_deadline_ms": 25,
        "request_timeout_s": 5,
        "avoid_prefill_tokens": 512,  # as configs/sim-local.yaml: off replicas mid-prefill
    },
    {
        "name": "chat",
        "priority": 1,
        "ttft_slo_ms": 1000,
        "max_concurrency": 8,
        "max_queue": 16,
        "queue_deadline_ms": 2000,
        "request_timeout_s": 60,
    },
    # Agent: long prompts, tolerant of seconds; queues longer.
    {
        "name": "agent",
        "priority": 2,
        "ttft_slo_ms": 3000,
        "max_concurrency": 6,
        "max_queue": 12,
        "queue_deadline_ms": 2000,
        "request_timeout_s": 20,
    },
]


def overload_config(pools: str, speedup: float) -> Any:
    """The cluster under test (see the module docstring); time limits are divided by ``speedup``
    so that the deployed (wall-clock) config is the product's config slowed down with the engines."""
    from cluster.config import load_config, parse_config

    raw = load_config(ROOT / "configs" / "sim-local.yaml").model_dump(mode="json")
    raw["name"] = APP
    # One gateway (as in sim-local.yaml, said here since the counters depend on it): the admission
    # counters read over HTTP are one gateway replica's, and each replica enforces its share of the
    # surfaces' limits.
    raw["server"]["gateway_replicas"] = 1
    base = raw["backends"][0]
    base.update(sim_profile=PROFILE, sim_options={"speedup": speedup, "seed": 7}, max_in_flight_per_replica=8)
    raw["models"][0]["context_window"] = 8192
    raw["surfaces"] = [
        {
            **s,
            "ttft_slo_ms": s["ttft_slo_ms"] / speedup,
            "queue_deadline_ms": s["queue_deadline_ms"] / speedup,
            "request_timeout_s": s["request_timeout_s"] / speedup,
        }
        for s in SURFACE_LIMITS
    ]
    if pools == "dedicated":
        tab = {**base, "name": "sim-tab", "replicas": 1}
        agent = {**base, "name": "sim-agent", "replicas": 2}
        raw["backends"] = [tab, agent]
        raw["routes"] = [
            {"model": MODEL, "surface": "tab", "candidates": ["sim-tab"]},
            {"model": MODEL, "candidates": ["sim-agent"]},
        ]
    else:
        base.update(name="sim-shared", replicas=3, max_in_flight_per_replica=3)
        raw["routes"] = [{"model": MODEL, "candidates": ["sim-shared"]}]
    return parse_config(raw)


def workloads(
    rates: dict[str, float],
    duration_s: float,
    seed: int,
    start_s: float = 0.0,
    shapes: dict[str, dict[str, int]] | None = None,
) -> list[RequestSpec]:
    """Tab and Agent requests at these rates (per second) for ``duration_s``; ``shapes``: the
    surfaces' :class:`~loadtest.common.workloads.SharedPrefixWorkload` fields (default ``SHAPES``)."""
    shapes = shapes or SHAPES
    out = []
    for i, (surface, rate) in enumerate(rates.items()):
        shape = shapes[surface]
        n = math.ceil(rate * duration_s * 1.2) + 1
        sessions = max(1, math.ceil(n / (shape["num_groups"] * shape["turns"])))
        wl = SharedPrefixWorkload(
            sessions_per_group=sessions, rate=rate, name=surface, surface=surface, start_s=start_s, **shape
        )
        out.append([s for s in wl.generate(seed + i) if s.arrival_s < start_s + duration_s])
    return merge(*out)


SHAPES: dict[str, dict[str, int]] = {
    "tab": {
        "num_groups": 8,  # repositories; a session edits one file, its prefix grows slowly
        "turns": 4,
        "system_prompt_words": 100,
        "context_words": 500,
        "question_words": 120,
        "answer_words": 12,
        "max_tokens": 16,
    },
    "agent": {
        "num_groups": 8,
        "turns": 4,
        "system_prompt_words": 700,
        "context_words": 1400,
        "question_words": 60,
        "answer_words": 120,
        "max_tokens": 64,
    },
}


async def closed_loop(
    url: str,
    specs: Sequence[RequestSpec],
    clients: dict[str, int],
    duration_s: float,
    timeout_s: float,
    model: str = MODEL,
) -> list[Result]:
    """``clients[surface]`` clients per surface, each sending its surface's specs back to back."""
    quiet_collector()  # no collector pause of ours inside the measurement
    by_surface = {s: itertools.cycle([x for x in specs if x.surface == s]) for s in clients}
    results: list[Result] = []
    async with session(timeout_s, max_connections=500) as client:
        t0 = time.perf_counter()

        async def worker(surface: str) -> None:
            while time.perf_counter() - t0 < duration_s:
                spec = next(by_surface[surface])
                r = Result(len(results), spec.session_id, surface)
                await stream_chat(client, url, spec, r, t0, timeout_s=timeout_s, model=model)
                results.append(r)

        await asyncio.gather(*(worker(s) for s, n in clients.items() for _ in range(n)))
    return results


def admission_counters(app_url: str) -> dict[str, Any]:
    """The gateway's admission counters (one gateway replica: see :func:`overload_config`)."""
    from deployments.launcher.local import gateway_status

    return gateway_status(app_url)["admission"]


def per_surface(
    results: Sequence[Result], cfg: Any, margin_s: float, window_s: float, speedup: float
) -> dict[str, dict[str, Any]]:
    """The client's view per surface. Times in simulated ms (wall x speedup, the unit of
    ``SURFACE_LIMITS``) and, as ``*_wall_ms``, as measured."""
    out: dict[str, dict[str, Any]] = {}
    for name in SURFACES:
        s = cfg.surface(name)
        rs = [r for r in results if r.surface == name]
        admitted = [r for r in rs if r.status == 200]
        ttfts = [r.ttft_s for r in admitted if r.ttft_s is not None]
        rejected = [r for r in rs if r.status in (429, 503)]
        deadline = s.request_timeout_s + margin_s
        p99 = percentile(ttfts, 99)
        slo_wall_ms = s.ttft_slo_ms
        out[name] = {
            "sent": len(rs),
            "admitted": len(admitted),
            "rejected_429": sum(r.status == 429 for r in rs),
            "rejected_503": sum(r.status == 503 for r in rs),
            "hung": sum(1 for r in rs if r.hung or (r.latency_s or 0) > deadline),
            "ttft_p50_ms": ms(percentile(ttfts, 50), speedup),
            "ttft_p99_ms": ms(p99, speedup),
            "slo_ms": round(slo_wall_ms * speedup, 1),
            "slo_met": p99 is not None and p99 * 1000 <= slo_wall_ms,
            "ttft_max_ms": ms(max(ttfts, default=None), speedup),
            "ttft_p50_wall_ms": ms(percentile(ttfts, 50)),
            "ttft_p99_wall_ms": ms(p99),
            "slo_wall_ms": slo_wall_ms,
            "other_status": dict(Counter(str(r.status) for r in rs if r.status not in (200, 429, 503))),
            "stream_errors": sum(1 for r in admitted if r.error is not None),
            "rejections_without_retry_after": sum(1 for r in rejected if not r.retry_after),
            "retry_after_s_wall": dict(
                sorted(Counter(r.retry_after for r in rejected if r.retry_after).items())
            ),
            "rejection_latency_max_wall_ms": ms(max((r.latency_s or 0 for r in rejected), default=None)),
            "queue_deadline_wall_ms": s.queue_deadline_ms,
            "latency_max_wall_s": round(max((r.latency_s or 0 for r in rs), default=0), 2),
            "deadline_wall_s": s.request_timeout_s,
            "offered_per_wall_s": round(len(rs) / window_s, 2),
            "admitted_per_wall_s": round(len(admitted) / window_s, 2),
            "output_tokens": sum(r.output_tokens for r in admitted),
        }
    return out


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--pools", choices=("dedicated", "shared"), default="dedicated")
    ap.add_argument("--speedup", type=float, default=0.05, help="simulated seconds per wall second")
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / measured capacity")
    ap.add_argument("--calib-s", type=float, default=30.0, help="closed-loop capacity phase (wall)")
    ap.add_argument("--duration-s", type=float, default=40.0, help="overload phase (wall)")
    ap.add_argument("--margin-s", type=float, default=5.0, help="hung: ended this long after its deadline")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "overload.json"))
    return ap.parse_args(argv)


@dataclass
class _Run:
    """What the two phases measured on the running cluster."""

    calib: list[Any]
    capacity: dict[str, float]
    calib_ttft: dict[str, dict[str, Any]]
    rates: dict[str, float]
    specs: list[Any]
    results: list[Any]
    wall: float
    before: dict[str, Any]
    after: dict[str, Any]


def _run_phases(
    args: argparse.Namespace, url: str, port: int, limits: dict[str, int], timeout_s: float
) -> _Run:
    asyncio.run(warm_up(url, 4))
    # 1. Capacity: every surface at its concurrency limit, closed loop.
    calib_specs = workloads({"tab": 10.0, "agent": 10.0}, 30.0, args.seed + 100)
    calib = asyncio.run(closed_loop(url, calib_specs, limits, args.calib_s, timeout_s))
    capacity = {
        s: round(sum(1 for r in calib if r.surface == s and r.status == 200) / args.calib_s, 3)
        for s in SURFACES
    }
    calib_ttft = {
        s: {
            f"p{q}": ms(
                percentile([r.ttft_s for r in calib if r.surface == s and r.ttft_s is not None], q),
                args.speedup,
            )
            for q in (50, 99)
        }
        for s in SURFACES
    }
    print(f"capacity (req per wall s, at the limits) {capacity}; TTFT sim ms {calib_ttft}", flush=True)
    time.sleep(2.0)
    # 2. Overload: factor x capacity, open loop.
    rates = {s: args.factor * capacity[s] for s in SURFACES}
    specs = workloads(rates, args.duration_s, args.seed)
    before = admission_counters(f"http://127.0.0.1:{port}")
    results, wall = asyncio.run(replay(url, specs, timeout_s=timeout_s, closed_loop=False))
    time.sleep(1.0)
    after = admission_counters(f"http://127.0.0.1:{port}")
    return _Run(calib, capacity, calib_ttft, rates, specs, results, wall, before, after)


def _checks(
    surfaces: dict[str, dict[str, Any]], delta: dict[str, int], after: dict[str, Any]
) -> dict[str, bool]:
    ok_200 = sum(v["admitted"] for v in surfaces.values())
    rejected = sum(v["rejected_429"] + v["rejected_503"] for v in surfaces.values())
    ended = delta["completed"] + delta["errored"] + delta["cancelled"]
    return {
        "tab_ttft_p99_within_slo": surfaces["tab"]["slo_met"],
        "rejections_are_429_or_503_with_retry_after": all(
            v["rejections_without_retry_after"] == 0 and not v["other_status"] for v in surfaces.values()
        ),
        "none_hung": all(v["hung"] == 0 for v in surfaces.values()),
        "admitted_equals_ended": delta["admitted"] == ended,
        "nothing_in_flight_or_waiting_after": after["in_flight"] == 0 and after["waiting"] == 0,
        "counters_balanced": bool(after["balanced"]),
        "client_200s_equal_admitted": ok_200 == delta["admitted"],
        "client_rejections_equal_counted": rejected
        == sum(delta.get(k, 0) for k in ("rejected_queue_full", "rejected_deadline", "rejected_predicted"))
        + delta.get("rejected_unreachable", 0)
        + delta.get("rejected_guard", 0),
    }


def _config_summary(cfg: Any) -> dict[str, Any]:
    return {
        "surfaces_sim_time": [x for x in SURFACE_LIMITS if x["name"] in SURFACES],
        "backends": [
            {
                "name": b.name,
                "replicas": b.replicas,
                "max_in_flight_per_replica": b.max_in_flight_per_replica,
            }
            for b in cfg.backends
        ],
        "routes": [r.model_dump() for r in cfg.routes],
        "profile": PROFILE,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Worker processes of a busy shared machine can take minutes to start (Ray gives them 60 s).
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
    t_start = time.perf_counter()

    from deployments.launcher import local

    cfg = overload_config(args.pools, args.speedup)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    meta = machine()
    limits = {s: cfg.surface(s).max_concurrency for s in SURFACES}
    timeout_s = max(cfg.surface(s).request_timeout_s for s in SURFACES) + args.margin_s
    local.start(cfg, port=port, metrics_port=0)
    try:
        run = _run_phases(args, url, port, limits, timeout_s)
    finally:
        local.stop()

    before, after = run.before, run.after
    delta = {k: v - before[k] for k, v in after.items() if type(v) is int}
    surfaces = per_surface(run.results, cfg, args.margin_s, args.duration_s, args.speedup)
    checks = _checks(surfaces, delta, after)
    report = {
        "benchmark": "overload",
        "pools": args.pools,
        "speedup": args.speedup,
        "factor": args.factor,
        "capacity_per_wall_s": run.capacity,
        "offered_per_wall_s": {s: round(r, 3) for s, r in run.rates.items()},
        "surfaces": surfaces,
        "checks": checks,
        "all_checks_passed": all(checks.values()),
        "counters": {"before": before, "after": after, "delta": delta},
        "calibration": {
            "duration_wall_s": args.calib_s,
            "clients": limits,
            "ttft_sim_ms": run.calib_ttft,
            "statuses": dict(Counter(f"{r.surface}:{r.status}" for r in run.calib)),
        },
        "config": _config_summary(cfg),
        "workload": {**summary(run.specs), "open_loop": True, "duration_wall_s": args.duration_s},
        "replay_wall_s": round(run.wall, 1),
        "machine": meta,
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "provenance": provenance(sys.argv[1:] if argv is None else argv, git, load0, started),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    _print_summary(surfaces, checks)
    print(f"wrote {args.out} in {report['runtime_s']} s")
    return 0


def _print_summary(surfaces: dict[str, dict[str, Any]], checks: dict[str, bool]) -> None:
    for name, v in surfaces.items():
        print(
            f"{name:5s} sent {v['sent']} admitted {v['admitted']} 429 {v['rejected_429']} "
            f"503 {v['rejected_503']} hung {v['hung']}  ttft p50/p99 {v['ttft_p50_ms']}/{v['ttft_p99_ms']} "
            f"sim ms (slo {v['slo_ms']}; wall p99 {v['ttft_p99_wall_ms']})",
            flush=True,
        )
    print(json.dumps(checks, indent=2))


if __name__ == "__main__":
    sys.exit(main())
