"""Hedging benchmark (issues 6 and 22): does racing a second attempt cut the slow tail of TTFT?

Real time, the whole request path (HAProxy, the gateway, the engine or provider). Two legs, one
after the other, each on a fresh local Ray with three Serve apps side by side:

* ``sim``: four simulated H100 replicas behind one backend;
* ``provider``: two provider backends in one route, both on a loopback OpenAI server.

Each leg first measures the no-fault TTFT median (``--calibrate`` requests); the fault is then
"5 % of calls 10x slower to their first token than that median" (an extra delay of 9x the median,
the sim's ``extra_latency_*`` options or the loopback server's seeded ``slow_first`` draw).
Variants: ``no_fault``, ``hedge_off`` (faults), ``hedge_on`` (faults, the default hedge policy:
after the observed TTFT p95, at most 5 % extra upstream requests). The requests go out in rounds,
``--round`` to each variant in turn, so the machine's load falls on all three alike, until each
has ``--requests``. Per request: TTFT and the gateway's ``x-llmc-attempts`` / ``x-llmc-hedge-won``.
Upstream, from the engines' and the server's own counters: attempts received, finished, and the
losing attempts cancelled (a loser not cancelled would finish: ``losers_not_cancelled``).

    python -m loadtest.benchmarks.bench_hedging [--requests 1000] [--legs sim,provider]

Writes loadtest/results/hedging.json: the sim leg's ``p99_ttft_ms_no_fault``,
``p99_ttft_ms_hedge_off``, ``p99_ttft_ms_hedge_on``, ``extra_request_ratio`` at the top, and every
leg's variants under ``legs``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cluster.config import ClusterConfig, parse_config
from cluster.policy.hedging import HedgeConfig
from loadtest.benchmarks.hedge_bound import hedge_window
from loadtest.common.client import EventStream
from loadtest.common.procs import quiet_collector
from loadtest.common.provenance import git_state, provenance
from loadtest.common.stats import quantile

RESULTS = Path(__file__).parents[1] / "results" / "hedging.json"
SHARE = 0.05  # of calls slow
FACTOR = 10.0  # slow calls' TTFT against the no-fault median
VARIANTS = ("no_fault", "hedge_off", "hedge_on")
GOAL = "hedge-on p99 within 1.5x of the no-fault p99 at <= 5 % extra upstream requests"
# The default policy (TTFT p95, 5 % budget), with a fixed delay while the sketch is cold; the
# feasibility window reads its budget and floor from the same settings.
HEDGING = HedgeConfig(fixed_delay_s=0.1)
# server.gc_freeze of every app (--no-gc-freeze: the replicas' startup heap is not frozen, for A/B)
GC_FREEZE = {"on": True}


def _app(name: str, backends: list[dict[str, Any]], candidates: list[str], hedging: bool) -> ClusterConfig:
    return parse_config(
        {
            "name": name,
            # One gateway: its hedge counters (GET /internal/status) are then the app's.
            "server": {"gateway_replicas": 1, "gc_freeze": GC_FREEZE["on"]},
            "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 4096, "default_max_tokens": 4}],
            "backends": backends,
            "routes": [{"model": "m", "candidates": candidates}],
            "surfaces": [{"name": "chat", "hedging": hedging, "max_concurrency": 256}],
            "policies": {"hedging": HEDGING.model_dump(exclude_defaults=True)},
        }
    )


def sim_app(name: str, slow_s: float | None, hedging: bool) -> ClusterConfig:
    opts: dict[str, Any] = {"seed": 7}
    if slow_s is not None:
        opts.update(extra_latency_s=slow_s, extra_latency_fraction=SHARE)
    sim = {
        "name": "sim",
        "kind": "sim",
        "model": "m",
        "replicas": 4,
        "resources": {"num_cpus": 0.1},
        "sim_profile": "llama-3.1-8b-h100",
        "sim_options": opts,
    }
    return _app(name, [sim], ["sim"], hedging)


def provider_app(name: str, url: str, key_env: str, hedging: bool) -> ClusterConfig:
    from loadtest.common.reliability import provider_backend

    backends = [
        provider_backend(n, "openai", url, "m", key_env=key_env, first_token_timeout_s=10)
        for n in ("prov-a", "prov-b")
    ]
    return _app(name, backends, ["prov-a", "prov-b"], hedging)


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


async def one(client: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                return {"i": i, "ok": False, "status": r.status_code, "error": text}
            ttft: float | None = None
            async for data in EventStream().aiter(r):  # read to the end: the winner finishes
                if ttft is None and '"content":"' in data:
                    ttft = time.perf_counter() - t0
    except httpx.HTTPError as e:
        return {"i": i, "ok": False, "error": type(e).__name__}
    if ttft is None:
        return {"i": i, "ok": False, "error": "no content"}
    return {
        "i": i,
        "ok": True,
        "ttft_ms": round(ttft * 1000, 2),
        "attempts": int(r.headers.get("x-llmc-attempts", "1")),
        "hedge_won": r.headers.get("x-llmc-hedge-won") == "1",
    }


async def batch(url: str, idx: range, concurrency: int) -> list[dict[str, Any]]:
    quiet_collector()  # no collector pause of ours inside the measurement
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as client:

        async def go(i: int) -> dict[str, Any]:
            async with sem:
                return await one(client, url, i)

        return list(await asyncio.gather(*(go(i) for i in idx)))


def ms(xs: list[float], q: float) -> float:
    return round(quantile(xs, q), 1)


def summarize(rows: list[dict[str, Any]], median_ms: float) -> dict[str, Any]:
    ok = [r for r in rows if r["ok"]]
    xs = [r["ttft_ms"] for r in ok]
    extra = sum(r["attempts"] - 1 for r in ok)
    slow = [r for r in ok if r["ttft_ms"] > 0.5 * FACTOR * median_ms]
    return {
        "n": len(rows),
        "errors": len(rows) - len(ok),
        "ttft_p50_ms": ms(xs, 0.5),
        "ttft_p90_ms": ms(xs, 0.9),
        "ttft_p99_ms": ms(xs, 0.99),
        "hedged": sum(1 for r in ok if r["attempts"] > 1),
        "hedges_won": sum(1 for r in ok if r["hedge_won"]),
        "extra_attempts": extra,
        "extra_request_ratio": round(extra / max(1, len(ok)), 4),
        # requests still slow at the client (over half the fault's TTFT): hedged or not
        "slow_at_client": len(slow),
        "slow_at_client_hedged": sum(1 for r in slow if r["attempts"] > 1),
    }


# --------------------------------------------------------------------------------------------
# Upstream counters
# --------------------------------------------------------------------------------------------


def sim_counts(app_url: str) -> dict[str, int]:
    from deployments.launcher.local import replica_stats

    out = {"received": 0, "finished": 0, "aborted": 0, "cancelled_while_slow": 0, "in_flight": 0}
    for s in replica_stats(app_url).values():
        cancelled_slow = int(s.extra.get("extra_latency_cancelled", 0))
        out["received"] += s.requests_started + cancelled_slow
        out["finished"] += s.requests_finished
        out["aborted"] += s.requests_aborted
        out["cancelled_while_slow"] += cancelled_slow
        out["in_flight"] += s.running + s.waiting
    return out


def server_counts(server: Any) -> dict[str, int]:
    st = server.wait_settled(10)
    done = sum(1 for r in st.records if r.outcome == "ok")
    return {"received": st.requests, "finished": done, "aborted": st.disconnects, "in_flight": st.in_flight}


def upstream(before: dict[str, int], after: dict[str, int], n: int, extra: int) -> dict[str, Any]:
    d = {k: after[k] - before.get(k, 0) for k in after if k != "in_flight"}
    losers = d["received"] - n  # every attempt past one per client request lost its race
    return {
        **d,
        "in_flight_at_rest": after["in_flight"],
        "attempts_seen_by_gateway": n + extra,
        "losers": losers,
        # a loser that was not cancelled ran to its end: finished beyond one per request
        "losers_not_cancelled": max(0, d["finished"] - n),
    }


# --------------------------------------------------------------------------------------------
# One leg
# --------------------------------------------------------------------------------------------


class Leg:
    """One leg's three apps on one local Ray (and, for ``provider``, their loopback servers)."""

    def __init__(self, leg: str, args: argparse.Namespace, port: int) -> None:
        self.leg, self.args, self.port = leg, args, port
        self.urls = {v: f"http://127.0.0.1:{port}/hedge-{leg}-{v}" for v in VARIANTS}
        self.chat = {v: u + "/v1/chat/completions" for v, u in self.urls.items()}
        self.servers: dict[str, Any] = {}
        self.delays: list[dict[str, float | None]] = []  # hedge_on's delay (ms) after each round

    def _deploy(self, v: str, cfg_of: Any) -> None:
        from deployments.launcher import local

        local.start(
            cfg_of(f"hedge-{self.leg}-{v}"),
            port=self.port,
            metrics_port=0,
            route_prefix=f"/hedge-{self.leg}-{v}",
        )

    def start_no_fault(self) -> None:
        if self.leg == "sim":
            self._deploy("no_fault", lambda n: sim_app(n, None, False))
            return
        from fixtures.servers.openai_server import OpenAIServer

        key_env = _export_key()
        for v in VARIANTS:
            server = self.servers[v] = OpenAIServer(output_tokens=4).start()
            url = server.base_url
            self._deploy(v, lambda n, url=url, v=v: provider_app(n, url, key_env, v == "hedge_on"))

    def start_faults(self, slow_s: float) -> None:
        for seed, v in enumerate(("hedge_off", "hedge_on"), 1):
            if self.leg == "sim":
                self._deploy(v, lambda n, v=v: sim_app(n, slow_s, v == "hedge_on"))
            else:
                self.servers[v].set_random_fault(f"slow_first:{slow_s}", SHARE, seed)

    def counts(self, v: str) -> dict[str, int]:
        return sim_counts(self.urls[v]) if self.leg == "sim" else server_counts(self.servers[v])

    def send(self, v: str, idx: range) -> list[dict[str, Any]]:
        return asyncio.run(batch(self.chat[v], idx, self.args.concurrency))

    def calibrate(self) -> float:
        self.send("no_fault", range(50))  # warm-up
        cal = self.send("no_fault", range(self.args.calibrate))
        return quantile([r["ttft_ms"] for r in cal if r["ok"]], 0.5)

    def interleaved(self) -> tuple[dict[str, list[dict[str, Any]]], dict[str, float]]:
        from deployments.launcher.local import gateway_status

        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        walls = dict.fromkeys(VARIANTS, 0.0)
        n, step = self.args.requests, self.args.round
        for start in range(0, n, step):
            for v in VARIANTS:  # the same request indices to each, in turn
                t0 = time.monotonic()
                rows[v] += self.send(v, range(start, min(n, start + step)))
                walls[v] += time.monotonic() - t0
            pol = gateway_status(self.urls["hedge_on"])["policy"]  # the delay it hedged after
            self.delays.append(
                {k: None if d is None else round(d * 1000, 1) for k, d in pol["hedge_delay_s"].items()}
            )
        return rows, walls

    def stop(self) -> None:
        from deployments.launcher import local

        local.stop()
        for s in self.servers.values():
            s.stop()


def run_leg(leg: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    from deployments.launcher.local import gateway_status

    run = Leg(leg, args, port)
    try:
        run.start_no_fault()
        median_ms = run.calibrate()
        if not median_ms == median_ms:  # nan: no request was served
            raise RuntimeError(f"[{leg}] the no-fault app served nothing: {run.send('no_fault', range(1))}")
        slow_s = round((FACTOR - 1) * median_ms / 1000, 4)
        print(f"[{leg}] no-fault TTFT median {median_ms:.1f} ms: slow calls wait {slow_s * 1000:.1f} ms more")
        run.start_faults(slow_s)
        for v in VARIANTS:  # fills each gateway's TTFT sketch past min_samples
            run.send(v, range(30))
        before = {v: run.counts(v) for v in VARIANTS}
        policy0 = {v: gateway_status(run.urls[v])["policy"] for v in VARIANTS}
        rows, walls = run.interleaved()
        time.sleep(1.0)  # the last losers' cancels land
        out: dict[str, Any] = {"median_no_fault_ms": round(median_ms, 1), "slow_extra_s": slow_s}
        out["variants"] = {}
        for v in VARIANTS:
            s = summarize(rows[v], median_ms)
            status = gateway_status(run.urls[v])
            pol = status["policy"]
            s["wall_s"] = round(walls[v], 1)
            s["gateway_gc"] = status.get("gc")  # the collector's pauses in the gateway, last 60 s
            keys = ("hedges_sent", "hedges_won", "hedges_cancelled", "hedges_refused")
            s["gateway"] = {k: pol[k] - policy0[v][k] for k in keys}
            s["upstream"] = upstream(before[v], run.counts(v), len(rows[v]), s["extra_attempts"])
            out["variants"][v] = s
            print(f"[{leg}] {v}: {json.dumps(s)}", flush=True)
        out["hedge_on_delay_ms_by_round"] = run.delays
        out["feasibility"] = hedge_window(
            [r["ttft_ms"] for r in rows["no_fault"] if r["ok"]],
            SHARE,
            HEDGING.budget_ratio,
            1000 * HEDGING.min_delay_s,
        )
        # per request, for reading a missed goal: [index, TTFT ms (None: failed), attempts, hedge won]
        out["requests"] = {v: [_row(r) for r in rows[v]] for v in VARIANTS}
        return out
    finally:
        run.stop()


def _row(r: dict[str, Any]) -> list[Any]:
    return [r["i"], r.get("ttft_ms"), r.get("attempts", 0), int(r.get("hedge_won", False))]


def _export_key() -> str:
    """The adapters read the provider key from the environment the replicas inherit."""
    name = "LLMC_BENCH_PROVIDER_KEY"
    os.environ.setdefault(name, "sk-loopback")
    return name


def headline(legs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for leg, d in legs.items():
        v = d["variants"]
        prefix = "" if leg == "sim" else f"{leg}_"
        out[f"{prefix}p99_ttft_ms_no_fault"] = v["no_fault"]["ttft_p99_ms"]
        out[f"{prefix}p99_ttft_ms_hedge_off"] = v["hedge_off"]["ttft_p99_ms"]
        out[f"{prefix}p99_ttft_ms_hedge_on"] = v["hedge_on"]["ttft_p99_ms"]
        out[f"{prefix}extra_request_ratio"] = v["hedge_on"]["extra_request_ratio"]
        ratio = v["hedge_on"]["ttft_p99_ms"] / max(1e-9, v["no_fault"]["ttft_p99_ms"])
        d["goal_met"] = ratio <= 1.5 and v["hedge_on"]["extra_request_ratio"] <= 0.05
        d["hedge_on_p99_over_no_fault_p99"] = round(ratio, 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="per variant")
    ap.add_argument("--calibrate", type=int, default=200, help="no-fault requests for the median")
    ap.add_argument("--round", type=int, default=50, help="requests to one variant before the next")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--legs", default="sim,provider")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-gc-freeze", action="store_true", help="replicas keep their startup heap unfrozen")
    args = ap.parse_args(argv)
    GC_FREEZE["on"] = not args.no_gc_freeze
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    from deployments.launcher.local import free_port

    legs = {leg: run_leg(leg, args, free_port()) for leg in args.legs.split(",")}
    out = {
        **headline(legs),
        "goal": GOAL,
        "fault": f"{SHARE:.0%} of calls {FACTOR:g}x the no-fault TTFT median to their first token",
        "legs": legs,
        "machine": "2-core shared CPU machine; sim: 4 simulated H100 replicas; provider: loopback OpenAI",
        "gc_freeze": GC_FREEZE["on"],
        "provenance": provenance(argv if argv is not None else sys.argv[1:], git, load0, started),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "legs"}, indent=2))


if __name__ == "__main__":
    main()
