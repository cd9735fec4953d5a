"""Hedging benchmark (issue 6): 5 % of backend calls are 10x slow to their first token; p99 TTFT with
hedging off and on, beside the no-fault p99, and the extra upstream requests hedging cost. Side by
side in one run: three Serve apps (no fault / faults, hedging off / faults, hedging on) on one local
Ray, four simulated H100 replicas each, the same request sequence sent to each.

    python -m loadtest.bench_hedging [--requests 300] [--concurrency 6]

Writes loadtest/results/hedging.json (p99_ttft_ms_no_fault, p99_ttft_ms_hedge_off,
p99_ttft_ms_hedge_on, extra_request_ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cluster.config import ClusterConfig, parse_config
from loadtest.client import EventStream
from loadtest.provenance import git_state, provenance
from loadtest.stats import quantile

RESULTS = Path(__file__).parent / "results" / "hedging.json"
SLOW_S = 0.5  # the fault: 0.5 s before the first token, ~10x the no-fault TTFT here


def app_config(name: str, slow: bool, hedging: bool) -> ClusterConfig:
    sim_options: dict[str, Any] = {"seed": 7}
    if slow:
        sim_options.update(extra_latency_s=SLOW_S, extra_latency_fraction=0.05)
    return parse_config(
        {
            "name": name,
            # One gateway: the hedge counters read below (GET /internal/status) are one gateway
            # replica's, and exact only when there is one.
            "server": {"gateway_replicas": 1},
            "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 4096, "default_max_tokens": 4}],
            "backends": [
                {
                    "name": "sim",
                    "kind": "sim",
                    "model": "m",
                    "replicas": 4,
                    "resources": {"num_cpus": 0.1},
                    "sim_profile": "llama-3.1-8b-h100",
                    "sim_options": sim_options,
                }
            ],
            "surfaces": [{"name": "chat", "hedging": hedging, "max_concurrency": 256}],
            # Defaults: hedge after the observed TTFT p95 (fixed 0.1 s while fewer than 20 samples),
            # at most 5 % extra upstream requests.
            "policies": {"hedging": {"fixed_delay_s": 0.1}},
        }
    )


async def ttft(client: httpx.AsyncClient, url: str, i: int) -> float:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": 4,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for data in EventStream().aiter(r):
            if '"content":"' in data:
                return time.perf_counter() - t0
    raise RuntimeError("no content")


async def drive(url: str, n: int, concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    out: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> None:
            async with sem:
                out.append(await ttft(client, url, i))

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def pct(xs: list[float], q: float) -> float:
    return quantile(xs, q / 100) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=6)
    args = ap.parse_args()
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    from deployments import local

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    variants = {
        "no_fault": app_config("hedge-nofault", slow=False, hedging=False),
        "hedge_off": app_config("hedge-off", slow=True, hedging=False),
        "hedge_on": app_config("hedge-on", slow=True, hedging=True),
    }
    results: dict[str, Any] = {}
    try:
        for cfg in variants.values():
            local.start(cfg, port=port, metrics_port=0, route_prefix=f"/{cfg.name}")
        for key, cfg in variants.items():  # one after another, the same sequence each time
            url = f"http://127.0.0.1:{port}/{cfg.name}/v1/chat/completions"
            asyncio.run(drive(url, 20, args.concurrency))  # warm-up: fills the TTFT sketch
            t0 = time.monotonic()
            xs = asyncio.run(drive(url, args.requests, args.concurrency))
            snap = local.gateway_status(f"http://127.0.0.1:{port}/{cfg.name}")["policy"]
            results[key] = {
                "n": len(xs),
                "ttft_p50_ms": round(pct(xs, 50), 1),
                "ttft_p99_ms": round(pct(xs, 99), 1),
                "wall_s": round(time.monotonic() - t0, 1),
                "hedges_sent": snap["hedges_sent"],
                "hedges_won": snap["hedges_won"],
                "extra_request_ratio": round(snap["extra_load_ratio"], 4),
            }
            print(key, results[key], flush=True)
    finally:
        local.stop()
    out = {
        "p99_ttft_ms_no_fault": results["no_fault"]["ttft_p99_ms"],
        "p99_ttft_ms_hedge_off": results["hedge_off"]["ttft_p99_ms"],
        "p99_ttft_ms_hedge_on": results["hedge_on"]["ttft_p99_ms"],
        "extra_request_ratio": results["hedge_on"]["extra_request_ratio"],
        "goal": "hedge-on p99 within 1.5x of the no-fault p99 at <= 5 % extra upstream requests",
        "fault": f"5 % of calls wait {SLOW_S} s before their first token (SimOptions.extra_latency_*)",
        "variants": results,
        "load_avg_1m": os.getloadavg()[0],
        "machine": "2-core shared CPU machine, 4 simulated H100 replicas per variant",
        "provenance": provenance(sys.argv[1:], git, load0, started),
    }
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "variants"}, indent=2))


if __name__ == "__main__":
    main()
