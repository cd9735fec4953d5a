"""Mid-stream migration benchmark (issue 19): Agent streams on simulated replicas, one replica killed
mid-answer per round; how many of its streams still complete, with which tokens, how long the seam
took and what the continuation prefilled again.

One local Ray Serve app: one gateway, four simulated H100 replicas (seeded sampler), the Agent
surface's shape (a 3,000-token shared repository context, 200 to 1,000 output tokens, scaled by
``--scale``). First the streams run without a fault (the reference: each one's token ids); then,
per round, the same streams again with the replica that holds most of them killed once every
stream has ``--kill-after`` tokens, and Serve's replacement awaited before the next round.

    python -m loadtest.benchmarks.bench_migration [--streams 16] [--rounds 2] [--scale 0.5]

Writes loadtest/results/migration.json: ``completed_after_kill_ratio`` (the killed replica's
streams that completed, goal 1.0), ``identical_to_reference_ratio``, seam TTFT p50/p99 (from the
last token before the break to the first after it, as the client saw it), extra prefill tokens
per migration (the continuation's prompt: the client's prompt plus the tokens already sent), the
gateway's migration counters, and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from cluster.config import ClusterConfig, parse_config
from deployments.internal import debug_ids_headers
from loadtest.common.procs import quiet_collector
from loadtest.common.provenance import git_state, provenance
from loadtest.common.surfaces import SHAPES, Session

RESULTS = Path(__file__).parents[1] / "results" / "migration.json"
APP, BACKEND, REPLICAS = "bench-migration", "sim-agent", 4


def app_config() -> ClusterConfig:
    return parse_config(
        {
            "name": APP,
            "server": {"gateway_replicas": 1, "default_surface": "agent"},  # one gateway: exact counters
            "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 16384}],
            "backends": [
                {
                    "name": BACKEND,
                    "kind": "sim",
                    "model": "m",
                    "replicas": REPLICAS,
                    "resources": {"num_cpus": 0.1},
                    "sim_profile": "llama-3.1-8b-h100",
                }
            ],
            "surfaces": [{"name": "agent", "priority": 2, "max_concurrency": 256, "max_queue": 256}],
            "policies": {"migration": {"min_per_s": 10.0}},  # every kill here is within the budget
        }
    )


def workload(n: int, scale: float, seed: int) -> list[dict[str, Any]]:
    """The first request of ``n`` seeded Agent sessions, each with its own sampling seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        spec = Session(SHAPES["agent"], f"agent-{i}", random.Random(rng.random()), scale=scale).next()
        assert spec is not None
        out.append(spec.body("m") | {"seed": 1000 + i, "ignore_eos": True})
    return out


async def stream(c: httpx.AsyncClient, url: str, body: dict[str, Any], seen: dict[str, Any]) -> None:
    """One stream, read raw: its replica, token ids (``: ids`` lines) with arrival times, usage."""
    seen.update(ids=[], at=[], usage=None, error=None, done=False)
    try:
        headers = {"x-surface": "agent", **debug_ids_headers()}  # the token ids, which clients never see
        async with c.stream("POST", url, json=body, headers=headers) as r:
            seen["replica"] = r.headers.get("x-llmc-replica")
            async for line in r.aiter_lines():
                if line.startswith(": ids "):
                    ids = [int(t) for t in line[6:].split(",")]
                    seen["ids"] += ids
                    seen["at"] += [time.perf_counter()] * len(ids)
                elif line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    seen["error"] = ev.get("error", seen["error"])
                    seen["usage"] = ev.get("usage") or seen["usage"]
                elif line == "data: [DONE]":
                    seen["done"] = True
    except httpx.HTTPError as exc:
        seen["error"] = {"message": f"{type(exc).__name__}: {exc}"}


async def run_round(url: str, bodies: list[dict[str, Any]], kill_after: int | None) -> list[dict[str, Any]]:
    """All streams at once; with ``kill_after``, the busiest replica is killed once every stream
    has that many tokens. Each stream's record says whether it was on the victim."""
    quiet_collector()  # no collector pause of ours inside the measurement
    from fixtures.replicas import kill_replica

    seen: list[dict[str, Any]] = [{} for _ in bodies]
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, read=120)) as c:
        tasks = [asyncio.create_task(stream(c, url, b, s)) for b, s in zip(bodies, seen, strict=True)]
        if kill_after is not None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and any(len(s.get("ids", ())) < kill_after for s in seen):
                await asyncio.sleep(0.01)
            victim = Counter(s.get("replica") for s in seen).most_common(1)[0][0]
            t_kill = time.perf_counter()
            await asyncio.to_thread(kill_replica, APP, f"backend-{BACKEND}", victim)
            for s in seen:
                s["victim"], s["t_kill"] = s.get("replica") == victim, t_kill
        await asyncio.gather(*tasks)
    return seen


def seam(s: dict[str, Any]) -> tuple[int, float] | None:
    """(tokens before the seam, seconds across it): the longest gap between tokens after the kill."""
    at = s["at"]
    gaps = [(at[i] - at[i - 1], i) for i in range(1, len(at)) if at[i] >= s["t_kill"]]
    if not gaps:
        return None
    gap, i = max(gaps)
    return i, gap


def pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return round(xs[0] * 1000, 1)
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1000, 1)


def summarize(ref: list[dict[str, Any]], rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    hit = [(r, s) for got in rounds for r, s in zip(ref, got, strict=True) if s["victim"]]
    completed = [(r, s) for r, s in hit if s["done"] and s["error"] is None]
    same = [1 for r, s in completed if s["ids"] == r["ids"]]
    seams = [x for _, s in completed if (x := seam(s)) is not None]
    prefill = [s["usage"]["prompt_tokens"] + k for (_, s), (k, _) in zip(completed, seams, strict=False)]
    others = [s for got in rounds for s in got if not s["victim"]]
    return {
        "killed_replica_streams": len(hit),
        "completed_after_kill_ratio": round(len(completed) / len(hit), 4) if hit else None,
        "identical_to_reference_ratio": round(len(same) / len(hit), 4) if hit else None,
        "seam_ttft_ms_p50": pct([g for _, g in seams], 50),
        "seam_ttft_ms_p99": pct([g for _, g in seams], 99),
        "extra_prefill_tokens_per_migration_mean": round(statistics.mean(prefill), 1) if prefill else None,
        "other_streams_completed_ratio": round(
            sum(s["done"] and not s["error"] for s in others) / len(others), 4
        )
        if others
        else None,
        "errors": [s["error"] for _, s in hit if s["error"] is not None][:5],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.5, help="Agent prompt and output lengths x this")
    ap.add_argument("--kill-after", type=int, default=20, help="tokens every stream has at the kill")
    ap.add_argument("--seed", type=int, default=19)
    args = ap.parse_args(argv)
    started, load_before, git = time.monotonic(), os.getloadavg(), git_state()
    from deployments.launcher import local
    from loadtest.common.actor_probe import replaced

    port = local.free_port()
    base = f"http://127.0.0.1:{port}/{APP}"
    bodies = workload(args.streams, args.scale, args.seed)
    rounds: list[list[dict[str, Any]]] = []
    try:
        local.start(app_config(), port=port, metrics_port=0, route_prefix=f"/{APP}")
        ref = asyncio.run(run_round(base + "/v1/chat/completions", bodies, None))
        snap0 = local.gateway_status(base)["policy"]["migrations"]
        for _ in range(args.rounds):
            got = asyncio.run(run_round(base + "/v1/chat/completions", bodies, args.kill_after))
            rounds.append(got)
            victim = next(s["replica"] for s in got if s["victim"])
            deadline = time.monotonic() + 180  # Serve replaces the killed replica before the next round
            while not replaced(APP, f"backend-{BACKEND}", [victim], REPLICAS) and time.monotonic() < deadline:
                time.sleep(0.5)
            print(summarize(ref, [got]), flush=True)
        snap = local.gateway_status(base)["policy"]["migrations"]
    finally:
        local.stop()
    out = summarize(ref, rounds) | {
        "goal": "completed_after_kill_ratio 1.0 for self-hosted streams",
        "gateway_migrations": {k: v - snap0.get(k, 0) for k, v in snap.items()},
        "reference_all_completed": all(s["done"] and not s["error"] for s in ref),
        "params": vars(args) | {"replicas": REPLICAS, "profile": "llama-3.1-8b-h100", "surface": "agent"},
        "note": "seam TTFT as the client saw it (the longest token gap after the kill); a noisy 2-core box",
        "provenance": provenance(argv or sys.argv[1:], git, load_before, started),
    }
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "provenance"}, indent=2))


if __name__ == "__main__":
    main()
