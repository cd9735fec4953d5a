"""Microbenchmark of the affinity policy: one decision at 64 replicas over a full 1M-block index.

A script, not a test: ``python loadtest/benchmarks/bench_affinity_micro.py [--quick]``. Prints JSON and writes
``loadtest/results/affinity_micro.json``. Goal: <= 50 us per decision for a request of a few
thousand tokens, excluding the hashing of its tokens (measured separately, per algorithm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.routing.affinity import AffinityParams, AffinityRouter, ReplicaLoad
from cluster.routing.block_hash import BlockHasher
from loadtest.common.provenance import git_state, provenance

BLOCK = 16
REPLICAS = 64
PROMPT_TOKENS = 4096


def timed(fn, n: int) -> dict[str, float]:
    """Per-call microseconds: median, p99, mean over ``n`` calls (after a warm-up)."""
    for _ in range(min(n, 200)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1000)
    samples.sort()
    return {
        "p50_us": round(samples[len(samples) // 2], 2),
        "p99_us": round(samples[int(len(samples) * 0.99)], 2),
        "mean_us": round(statistics.fmean(samples), 2),
        "n": n,
    }


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _fill_index(router: AffinityRouter, replicas: list[str], rng: random.Random, index_blocks: int) -> None:
    filled = 0
    while filled < index_blocks:  # 256-block chains (4k-token prompts) spread over the replicas
        chain = [rng.getrandbits(63) for _ in range(256)]
        router.record(replicas[rng.randrange(REPLICAS)], chain, 0.0)
        filled += len(chain)


Case = tuple[list[int], list[ReplicaLoad], str | None]


def _cases(
    router: AffinityRouter, hashes: list[int], holder: str, replicas: list[str], rng: random.Random
) -> dict[str, Case]:
    """The decisions timed: a prefix hit (its holder within the load bound, then over it), a new
    prefix, a session, a prompt too short to hash."""
    router.record(holder, hashes[:192], 0.0)  # 3k of the 4k tokens cached on one replica
    router.record("replica-9", hashes[:64], 0.0, session_id="s-1")
    fresh = router.hash([rng.randrange(128_000) for _ in range(PROMPT_TOKENS)])
    loads = [ReplicaLoad(r, in_flight=rng.randrange(4, 12), waiting=rng.randrange(3)) for r in replicas]
    for x in loads:  # the prefix holder and the session's replica within the bound (~ceil(1.25 x 8))
        if x.replica in (holder, "replica-9"):
            x.in_flight = 6
    hot = [ReplicaLoad(r.replica, 30 if r.replica == holder else r.in_flight, r.waiting) for r in loads]
    return {
        "prefix_hit": (hashes, loads, None),
        "prefix_hit_holder_over_bound": (hashes, hot, None),
        "new_prefix_rendezvous": (fresh, loads, None),
        "session_sticky": (hashes, loads, "s-1"),
        "short_prompt_load_only": ([], loads, None),
    }


def _time_decisions(router: AffinityRouter, cases: dict[str, Case], n: int) -> dict[str, Any]:
    dec_rng = random.Random(1)
    decisions = {}
    for name, (hs, ld, sid) in cases.items():
        d = router.decide(hs, ld, dec_rng, 1.0, sid)
        stats = timed(lambda hs=hs, ld=ld, sid=sid: router.decide(hs, ld, dec_rng, 1.0, sid), n)
        decisions[name] = {
            **stats,
            "reason": d.reason,
            "matched_blocks": d.matched_blocks,
            "diverted": d.diverted,
        }
    return decisions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a 100k-block index and fewer samples")
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "results" / "affinity_micro.json"))
    args = ap.parse_args()
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    index_blocks = 100_000 if args.quick else 1_000_000
    n = 2_000 if args.quick else 20_000
    rng = random.Random(7)

    tokens = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    hashing = {}
    for algo in ("tuple", "blake2b"):
        h = BlockHasher(BLOCK, "llama-3.1-8b", "salt", algo)  # type: ignore[arg-type]
        hashing[algo] = timed(lambda h=h: h.hash_blocks(tokens), max(200, n // 10))

    router = AffinityRouter(BLOCK, "llama-3.1-8b", AffinityParams(index_capacity_blocks=index_blocks))
    replicas = [f"replica-{i}" for i in range(REPLICAS)]
    rss0 = rss_mb()
    t0 = time.perf_counter()
    _fill_index(router, replicas, rng, index_blocks)
    fill_s = time.perf_counter() - t0
    rss1 = rss_mb()

    hashes = router.hash(tokens)  # 256 blocks
    holder = replicas[5]
    cases = _cases(router, hashes, holder, replicas, rng)
    decisions = _time_decisions(router, cases, n)
    record = timed(lambda: router.index.record(holder, hashes), max(200, n // 10))

    result = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "replicas": REPLICAS,
        "block_size": BLOCK,
        "prompt_tokens": PROMPT_TOKENS,
        "prompt_blocks": len(hashes),
        "index_blocks": len(router.index),
        "index_fill_s": round(fill_s, 2),
        "index_rss_mb_approx": round(rss1 - rss0, 1),
        "hash_4096_tokens": hashing,
        "decide": decisions,
        "record_256_blocks": record,
        "goal_decide_us": 50,
        "goal_met": all(v["p50_us"] <= 50 for v in decisions.values()),
        "provenance": provenance(sys.argv[1:], git, load0, started),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
