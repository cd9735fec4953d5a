"""Replica choice side by side: the same shared-prefix workload against each routing policy.

    python -m loadtest.benchmarks.bench_affinity --scenario fits,kv_pressure   # issue 17's two scenarios
    python -m loadtest.benchmarks.bench_affinity --scenario fits,kv_pressure --offline  # virtual clock only
    python -m loadtest.benchmarks.bench_affinity --scenario common-prompt   # a product-wide prompt first
    python -m loadtest.benchmarks.bench_affinity --quick                    # a smoke run (~2 minutes)

One local Ray, one Serve app per policy (``llmc-aff-<policy>`` at route prefix ``/<policy>``),
fresh engines and cold caches each, deployed one after the other (``--mode sequential``, the
default: each app is deleted before the next starts, so every policy has the machine to itself).
``--mode concurrent`` deploys them all and replays the same schedule against all at the same moment,
so that all see the same contention from whatever else runs on the machine; on two shared cores that
overloads the single HTTP proxy (six apps are 36 Serve replicas) and measures the gateway's queue,
not the routers. Policies: round_robin, least_loaded, cache_aware (ours, as shipped: the index fed
by the engines' KV events, each request's cache rank ordering the engine's queue),
cache_aware+no_rank (the same without the cache rank: the engines queue by arrival) and
cache_aware+previous (ours before issue 17: routed-record index, rendezvous home for new prefixes,
no match ratio, no cache rank), each deployed through the backend's ``routing``
and ``affinity`` settings (a what-if is a config change) and decided by the gateway's routing view.
Scenarios ``fits`` and ``kv_pressure`` (issue 17) are the groups' workload with 32K and 8K tokens of
KV per replica. Serve's own power_of_two and
Ray's PrefixCacheAffinityRouter (ray_prefix) are no longer measured live: the engine deployments'
Serve request router is the gateway's shim (replicas are chosen in the gateway, and tokens stream
over HTTP, not through a Serve handle), so neither can be deployed on this data plane; the
virtual-clock what-if still emulates Ray's prefix router, and earlier live results stay in the
report under ``--merge``.

Engines: simulated Llama-3.1-8B on H100s (``llama-3.1-8b-h100``) with a KV cache cut to
``--kv-tokens`` per replica, so that the workload's shared contexts do not all fit in one replica
(on a real 80 GB H100 they all would, and the router would not matter for the hit rate), yet fit in
all of them. The simulation runs at ``--speedup`` (0.05: twenty times slower than real time): the
engines are busy at an arrival rate this machine's Ray can carry, and the gateway's own latency on
two shared, heavily used cores (tens to hundreds of ms) shrinks to a few simulated ms, about what it
is next to real GPUs. Every time is reported both ways.

Workload (:class:`loadtest.common.workloads.SharedPrefixWorkload`, scenario in ``SCENARIOS``): groups with
a long shared system prompt + repository context, Zipf-skewed sessions per group, multi-turn
growing conversations, Poisson arrivals. The client (aiohttp, streaming) sends each request at its
arrival time, except that a session's next turn waits for its previous one to end (closed-loop
sessions); each request carries its session id in ``x-session-id`` (only ours uses it).

Measured per policy:

* ``hit_rate`` — the engines' own prefix-cache counters: delta of hits / delta of queries summed
  over the replicas (vLLM's units: prompt tokens at first admission, whole blocks only);
  ``client_hit_rate`` — sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens.
* TTFT p50/p90/p99 — client side, send to the first content chunk, wall-clock ms (``ttft_*_ms``);
  ``ttft_*_sim_ms`` is the same times the speedup, i.e. in simulated H100 time (gateway included).
* ``output_tok_s`` — output tokens / wall time from the first send to the last end (wall clock);
  ``output_tok_s_sim`` divides by the speedup.

The oracle (``oracle_hit_rate``): the best hit rate any router could reach on this workload, taken as
ONE simulated engine with the combined KV cache and N times the compute and batch limits of the N
replicas (a perfectly pooled cluster: no prefix is ever cached twice, nothing waits for a busy
replica), replaying the same token ids at the same simulated arrival times with the same closed-loop
sessions, on the virtual clock, its queue ordered as ours are (a request whose prompt it holds at
arrival before one it does not; ``oracle.fcfs`` is the same engine in arrival order, the oracle of
the runs before the cache rank). A router splits the same memory into N separate LRU caches, so it
can only lose hits to duplication and fragmentation (LRU is not optimal caching, so this is an upper
bound in practice rather than a theorem).

``virtual_clock_whatif``: the same replay through N simulated engines on the virtual clock, without
Ray or HTTP (seconds to run, no CPU noise): ours as shipped and as before issue 17, each with and
without the engines' KV events (the real policy code; events applied at each decision, without the
live feed's lag), each new-prefix placement by config (``PLACEMENTS``: ``least_loaded``, ``home``),
behind one and two gateway replicas, and an emulation of Ray's prefix router
(``_RayPrefixEmulation``). It explains the live numbers and predicts them closely (hit rates within
a few points). ``--extra-seeds 2,3`` replays the placements and Ray's emulation on other workload
seeds too (``virtual_clock_whatif.other_workload_seeds``): one workload is one draw of which groups
are hot, and a placement's edge on one draw can be luck.

Goals (issues 5 and 17): ours >= 95 % of the oracle's hit rate when the contexts fit; under KV
pressure ours >= Ray's hit rate + 0.05 and TTFT p90 >= 1.3x better than Ray's (``goals``; Ray from
the virtual clock's emulation when it was not measured live).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import (  # the live client, shared with the overload benchmarks
    MODEL,
    PROFILE,
    RESULTS,
    ROOT,
    Result,
    machine,
    ms,
    percentile,
    replay,
    warm_up,
)
from loadtest.common.workloads import SharedPrefixWorkload, summary

# power_of_two (Serve's default request router) and ray_prefix (Ray's PrefixCacheAffinityRouter)
# were dropped: the gateway chooses the engine replica itself (its routing view, through the shim
# request router of every engine deployment) and streams from it over HTTP, so no Serve request
# router of ours or Ray's decides any more. The config still accepts both names, but the gateway
# deploys them as cache_aware (deployments/gateway/gateway.py), which would measure ours under their name.
POLICIES = (
    "round_robin",
    "least_loaded",
    "cache_aware",
    "cache_aware+no_rank",
    "cache_aware+previous",
    "cache_aware+2gw",
)
DROPPED = {"power_of_two", "ray_prefix"}
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B bf16: 128 KiB


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------

# Word counts; a word is ~1.3 tokens of the tiny tokenizer in this text (chat template included).
SCENARIOS: dict[str, dict[str, int]] = {
    # The workload: every group has its own system prompt and repository context.
    "groups": {"common_prefix_words": 0, "system_prompt_words": 400, "context_words": 1800},
    # A product-wide prompt (instructions, tool definitions: ~1.3k tokens, ~35 % of a prompt)
    # before every group's own prompt and context.
    "common-prompt": {"common_prefix_words": 1000, "system_prompt_words": 300, "context_words": 1300},
}
# Issue 17's two: the groups' workload when the contexts fit the cluster's KV (20 groups x ~2.9K
# tokens = ~58K against 4 x 32K) and when they do not (4 x 8K: the contexts' total is ~7x one
# replica's KV and ~1.8x the cluster's).
SCENARIOS["fits"] = SCENARIOS["kv_pressure"] = SCENARIOS["groups"]
SCENARIO_KV_TOKENS = {"fits": 32768, "kv_pressure": 8192}


def workload(args: argparse.Namespace) -> SharedPrefixWorkload:
    return SharedPrefixWorkload(
        num_groups=args.groups,
        sessions_per_group=args.sessions,
        turns=args.turns,
        question_words=40,
        answer_words=60,
        max_tokens=args.max_tokens,
        group_skew=args.skew,
        rate=args.rate,
        **SCENARIOS[args.scenario],
    )


# --------------------------------------------------------------------------------------------
# The cluster side
# --------------------------------------------------------------------------------------------


def policy_config(policy: str, args: argparse.Namespace) -> Any:
    from cluster.config import load_config, parse_config

    raw = load_config(ROOT / "configs" / "sim-local.yaml").model_dump(mode="json")
    raw["name"] = f"llmc-aff-{policy}"
    b = raw["backends"][0]
    b.update(
        replicas=args.replicas,
        routing="cache_aware" if policy in VARIANTS else policy,
        sim_profile=PROFILE,
        sim_options={"speedup": args.speedup, "seed": args.seed},
    )
    b["engine"] = {"kv_cache_memory_bytes": args.kv_tokens * KV_BYTES_PER_TOKEN}
    if policy in VARIANTS:
        b["affinity"], raw["server"]["gateway_replicas"] = VARIANTS[policy]
    raw["models"][0]["context_window"] = 8192
    return parse_config(raw)


def engine_totals(stats: dict[str, Any]) -> dict[str, int]:
    t: Counter[str] = Counter()
    for s in stats.values():
        t["queries"] += s.prefix_cache_queries
        t["hits"] += s.prefix_cache_hits
        t["running"] += s.running
        t["waiting"] += s.waiting
        t["preemptions"] += s.extra.get("preemptions", 0)
        t["evictions"] += s.extra.get("evictions", 0)
    return dict(t)


def settled_stats(app_url: str, replicas: int, timeout_s: float = 15.0) -> dict[str, Any]:
    """The replicas' stats once every replica reported, nothing runs and two snapshots agree
    (``app_url``: the app's URL with its route prefix; the engines are asked over HTTP)."""
    from deployments.launcher.local import replica_stats

    deadline = time.monotonic() + timeout_s
    last: dict[str, int] | None = None
    while True:
        stats = replica_stats(app_url)
        tot = engine_totals(stats)
        quiet = len(stats) >= replicas and tot.get("running", 0) == 0 and tot.get("waiting", 0) == 0
        if (quiet and tot == last) or time.monotonic() > deadline:
            return stats
        last = tot if quiet else None
        time.sleep(0.5)


def summarize(results: Sequence[Result], speedup: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None and not r.hung]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    span = max(r.sent_s + (r.latency_s or 0) for r in results) - min(r.sent_s for r in results)
    out: dict[str, Any] = {
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(Counter(str(r.status) for r in results if r not in ok)),
        "client_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None,
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_ms"] = ms(percentile(ttfts, q))
    out["output_tok_s"] = round(out_tokens / span, 1) if span > 0 else None
    for q in (50, 90, 99):
        out[f"ttft_p{q}_sim_ms"] = ms(percentile(ttfts, q), speedup)
    out["output_tok_s_sim"] = round(out_tokens / span / speedup, 1) if span > 0 else None
    out["prompt_tokens"] = prompt
    out["output_tokens"] = out_tokens
    out["span_s"] = round(span, 1)
    out["requests_per_replica"] = sorted(Counter(r.replica for r in ok).values(), reverse=True)
    by_group: dict[str, set[str]] = defaultdict(set)
    for r in ok:
        by_group[r.session_id.split("-")[0]].add(r.replica)
    out["replicas_per_group_mean"] = round(sum(len(v) for v in by_group.values()) / max(1, len(by_group)), 2)
    return out


def _app_url(policy: str, port: int) -> str:
    """The policy's app: its URL with the route prefix."""
    return f"http://127.0.0.1:{port}/{policy.replace('+', '-')}"


def _deploy(policy: str, args: argparse.Namespace, port: int, wait: bool) -> tuple[Any, str]:
    """Deploy one policy's app (the first call also starts Ray and Serve); returns (config, url)."""
    import ray
    from ray import serve

    from deployments import app as app_module
    from deployments.launcher import local

    cfg = policy_config(policy, args)
    prefix = f"/{policy.replace('+', '-')}"
    if wait or not ray.is_initialized():
        local.start(cfg, port=port, metrics_port=0, route_prefix=prefix)
    else:
        serve.run(app_module.build_graph(cfg), name=cfg.name, route_prefix=prefix, blocking=False)
    return cfg, _app_url(policy, port) + "/v1/chat/completions"


def _wait_running(names: Sequence[str], timeout_s: float = 600.0) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        apps = serve.status().applications
        states = [apps[n].status if n in apps else None for n in names]
        if any(st == ApplicationStatus.DEPLOY_FAILED for st in states):
            raise RuntimeError(f"an application failed to deploy: {dict(zip(names, states, strict=True))}")
        if all(st == ApplicationStatus.RUNNING for st in states):
            return
        time.sleep(1.0)
    raise TimeoutError(f"applications not running after {timeout_s} s")


def _decisions(policy: str, app_url: str) -> dict[str, int]:
    """The gateway's decision counts per (backend, reason); exact: sim-local.yaml runs one gateway."""
    from deployments.launcher.local import gateway_status

    if policy != "cache_aware" and policy not in VARIANTS:
        return {}
    routing = gateway_status(app_url)["routing"]
    return {f"{b}:{r}": n for b, view in routing.items() for r, n in view["decisions"].items()}


def _policy_result(
    results: Sequence[Result], before: dict[str, int], after: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    dq, dh = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {
        "hit_rate": round(dh / dq, 4) if dq else None,
        **summarize(results, args.speedup),
        "engine": {
            "queries": dq,
            "hits": dh,
            "preemptions": after["preemptions"] - before["preemptions"],
            "evictions": after["evictions"] - before["evictions"],
        },
    }


def run_sequential(
    policies: Sequence[str], specs: Sequence[RequestSpec], args: argparse.Namespace, port: int
) -> dict[str, Any]:
    """One app at a time: each policy has the machine to itself (but not the same moment of it)."""
    from ray import serve

    out: dict[str, Any] = {}
    for policy in policies:
        t0 = time.perf_counter()
        cfg, url = _deploy(policy, args, port, wait=True)
        deploy_s = time.perf_counter() - t0
        load = os.getloadavg()[0]
        try:
            asyncio.run(warm_up(url, 2 * args.replicas))
            app_url = _app_url(policy, port)
            before = engine_totals(settled_stats(app_url, args.replicas))
            results, _ = asyncio.run(replay(url, specs, timeout_s=args.request_timeout_s))
            after = engine_totals(settled_stats(app_url, args.replicas))
            decisions = _decisions(policy, app_url)
        finally:
            serve.delete(cfg.name)
        out[policy] = _policy_result(results, before, after, args)
        out[policy].update(deploy_s=round(deploy_s, 1), load_avg_1m_before=round(load, 2))
        if decisions:
            out[policy]["routing_decisions"] = decisions
        _print(policy, out[policy], time.perf_counter() - t0)
    return out


def run_concurrent(
    policies: Sequence[str], specs: Sequence[RequestSpec], args: argparse.Namespace, port: int
) -> dict[str, Any]:
    """Every policy's app at once, the same workload replayed against all of them at the same
    moment: each sees the same CPU contention from whatever else runs on the machine."""
    t0 = time.perf_counter()
    apps = {p: _deploy(p, args, port, wait=i == 0) for i, p in enumerate(policies)}
    _wait_running([cfg.name for cfg, _ in apps.values()])
    deploy_s = time.perf_counter() - t0

    async def warm_all() -> None:
        await asyncio.gather(*(warm_up(url, 2 * args.replicas) for _, url in apps.values()))

    async def replay_all() -> list[list[Result]]:
        runs = [replay(url, specs, timeout_s=args.request_timeout_s) for _, url in apps.values()]
        return [r for r, _ in await asyncio.gather(*runs)]

    asyncio.run(warm_all())
    before = {p: engine_totals(settled_stats(_app_url(p, port), args.replicas)) for p in apps}
    load = os.getloadavg()[0]
    t_run = time.perf_counter()
    results = dict(zip(apps, asyncio.run(replay_all()), strict=True))
    run_s = time.perf_counter() - t_run
    out: dict[str, Any] = {}
    for p in apps:
        after = engine_totals(settled_stats(_app_url(p, port), args.replicas))
        out[p] = _policy_result(results[p], before[p], after, args)
        out[p].update(deploy_s=round(deploy_s, 1), load_avg_1m_before=round(load, 2))
        decisions = _decisions(p, _app_url(p, port))
        if decisions:
            out[p]["routing_decisions"] = decisions
        _print(p, out[p], run_s)
    return out


def _print(policy: str, r: dict[str, Any], seconds: float) -> None:
    print(
        f"{policy:21s} hit {r['hit_rate']} (client {r['client_hit_rate']})  ttft p50/p90/p99 "
        f"{r['ttft_p50_sim_ms']}/{r['ttft_p90_sim_ms']}/{r['ttft_p99_sim_ms']} sim ms "
        f"({r['ttft_p90_ms']} wall p90)  {r['output_tok_s']} tok/s  ok {r['ok']}/{r['requests']}  "
        f"per replica {r['requests_per_replica']}  ({seconds:.0f} s)",
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# The proposed affinity changes: a config change (backends[].affinity), nothing patched
# --------------------------------------------------------------------------------------------

PREVIOUS = "cache_aware+previous"
# Ours without the cache rank: the engines order their queues by surface and arrival alone, as
# every run before the rank was made (``affinity.cache_priority: false``).
NO_RANK_POLICY = "cache_aware+no_rank"
# Issue 17 made min_match_ratio 0.5 and new prefixes to their context's home (cluster/routing/placement.py;
# before that, to the least loaded eligible replica) the config's defaults (``cache_aware``), with
# the index fed by the engines' KV events. ``cache_aware+previous`` is the policy shipped before
# it, for comparison: a 64-token match steers, a new prefix goes to the rendezvous home of its
# session id or first 64 tokens, and the index is the routed-record guess. Both are config
# (``backends[].affinity``), nothing patched.
PREVIOUS_AFFINITY: dict[str, Any] = {
    "min_match_ratio": 0.0,
    "new_prefix": "rendezvous",
    "cache_priority": False,
}
# name -> (the backend's affinity config, gateway replicas); "cache_aware+2gw" is ours as shipped
# behind two gateway replicas, each with its own index fed by the same events (issue 17's goal:
# within 0.02 of one gateway's hit rate).
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    PREVIOUS: ({**PREVIOUS_AFFINITY, "kv_events": False}, 1),
    "cache_aware+2gw": ({}, 2),
    NO_RANK_POLICY: ({"cache_priority": False}, 1),
}


def affinity_params(affinity: dict[str, Any] | None = None) -> Any:
    """The policy's parameters for a backend whose config says ``affinity`` (None: the defaults)."""
    from cluster.config import AffinityConfig
    from cluster.routing.affinity import AffinityParams

    return AffinityParams(**AffinityConfig.model_validate(affinity or {}).params())


# --------------------------------------------------------------------------------------------
# Virtual-clock replays: the oracle and the offline what-if (no Ray, seconds to run)
# --------------------------------------------------------------------------------------------


@dataclass
class _Scaled:
    base: Any
    factor: float

    def step_time(self, batch: Any) -> float:
        return self.base.step_time(batch) / self.factor


def sim_profile(args: argparse.Namespace, n: int = 1) -> Any:
    """The replicas' profile, or with ``n > 1`` one engine with n replicas' KV and batch limits."""
    from cluster.engine.profiles import get_profile

    p = get_profile(PROFILE).with_engine(
        kv_cache_bytes=args.kv_tokens * KV_BYTES_PER_TOKEN, max_model_len=8192
    )
    e = p.engine
    return p.with_engine(
        kv_cache_bytes=n * args.kv_tokens * KV_BYTES_PER_TOKEN,
        max_num_seqs=n * e.max_num_seqs,
        max_num_batched_tokens=n * e.max_num_batched_tokens,
    )


def simulate(
    specs: Sequence[RequestSpec],
    token_ids: Sequence[list[int]],
    engines: Sequence[Any],
    choose: Callable[[int, Sequence[Any], float], int | tuple[int, int]],
    scale: float,
) -> dict[str, Any]:
    """Replay on the engines' virtual clock with closed-loop sessions, as the live client does;
    ``choose(i, engines, now)`` picks the engine of request ``i``, or ``(engine, priority)``: the
    engine's queue key (:attr:`cluster.wire.protocol.GenerateRequest.engine_priority`)."""
    reqs: list[Any] = [None] * len(specs)
    last: dict[str, Any] = {}  # session -> its latest request
    held: dict[str, deque[int]] = defaultdict(deque)  # session -> turns waiting for the previous one

    def add(i: int, at: float) -> None:
        k = choose(i, engines, at)
        k, priority = k if isinstance(k, tuple) else (k, 0)
        reqs[i] = last[specs[i].session_id] = engines[k].add_request(
            f"v{i}", token_ids[i], specs[i].max_tokens, arrival_time=at, priority=priority
        )

    def advance(t: float) -> None:
        for e in engines:
            e.run_until(t)
        for session, q in held.items():
            if q and last[session].finish_time is not None:
                i = q.popleft()
                add(i, max(last[session].finish_time, specs[i].arrival_s * scale))

    for i, s in enumerate(specs):
        advance(s.arrival_s * scale)
        p = last.get(s.session_id)
        if held[s.session_id] or (p is not None and p.finish_time is None):
            held[s.session_id].append(i)
        else:
            add(i, s.arrival_s * scale)
    while any(held.values()):
        advance(min(e.now for e in engines) + 0.01)
    for e in engines:
        e.run()
    queries = sum(e.counters.prefix_cache_queries for e in engines)
    hits = sum(e.counters.prefix_cache_hits for e in engines)
    ttfts = [r.ttft for r in reqs if r is not None and r.ttft is not None]
    out: dict[str, Any] = {"hit_rate": round(hits / queries, 4), "queries": queries, "hits": hits}
    for q in (50, 90, 99):
        out[f"ttft_p{q}_sim_ms"] = ms(percentile(ttfts, q))
    out["requests_per_replica"] = sorted((e.counters.requests_added for e in engines), reverse=True)
    return out


def oracle(specs: Sequence[RequestSpec], token_ids: Sequence[list[int]], args: argparse.Namespace) -> Any:
    """One engine with N replicas' KV cache, N times the compute and the batch limits, ordering its
    queue as ours do (a request whose prompt it holds at arrival before one it does not); the same
    engine in arrival order alone is ``fcfs``."""
    from cluster.engine.kv import hash_request_tokens
    from cluster.engine.model import EngineModel

    n = args.replicas
    pooled = sim_profile(args, n)

    def pooled_engine(policy: str) -> Any:
        return EngineModel(
            pooled, step_time_model=_Scaled(pooled.step_time_model(), n), scheduling_policy=policy
        )

    def ranked(i: int, engines: Sequence[Any], now: float) -> tuple[int, int]:
        e = engines[0]
        hashes: list[Any] = []
        hash_request_tokens(token_ids[i], e.block_size, None, hashes)
        held = len(e.kv.computed_blocks(hashes, len(token_ids[i])))
        return 0, 0 if hashes and held >= ORACLE_RANK_RATIO * len(hashes) else 1

    out = simulate(specs, token_ids, [pooled_engine("priority")], ranked, args.speedup)
    fcfs = simulate(specs, token_ids, [pooled_engine("fcfs")], lambda i, e, now: 0, args.speedup)
    out["fcfs"] = {k: fcfs[k] for k in ("hit_rate", "ttft_p50_sim_ms", "ttft_p90_sim_ms", "ttft_p99_sim_ms")}
    out["definition"] = (
        f"one simulated {PROFILE} engine with {n}x the KV cache ({n} x {args.kv_tokens} tokens), "
        f"{n}x the compute and {n}x the batch limits (a perfectly pooled cluster: no prefix cached "
        "twice, no busy replica), replaying the same token ids at the same simulated times "
        "(wall arrival x speedup) with closed-loop sessions; its queue ordered as ours are (a "
        f"request whose prompt it holds >= {ORACLE_RANK_RATIO} of at arrival first, then arrival); "
        "'fcfs': the same engine in arrival order (the oracle of runs before the cache rank)"
    )
    return out


ORACLE_RANK_RATIO = 0.5  # the config's min_match_ratio: the share of a prompt that ranks it a hit


class _AffinityChoice:
    """Our policy deciding on the virtual clock; with ``logs`` (one per engine) it first applies
    the engines' KV events since its last decision, as the gateway's feed does (without its lag),
    and the chosen replica announces the request (``BlocksQueued``), as the engine replica does."""

    def __init__(
        self,
        policy: Any,
        specs: Sequence[RequestSpec],
        token_ids: Sequence[list[int]],
        logs: Sequence[Any] | None = None,
        indexer: _IndexerFeed | None = None,
    ) -> None:
        self.policy, self.specs, self.logs, self.indexer = policy, specs, logs, indexer
        self.hashes = [policy.hash(t) for t in token_ids]
        self.rng = random.Random(0)
        self.cursors = [(None, 0)] * len(logs or ())

    def __call__(self, i: int, engines: Sequence[Any], now: float) -> int:
        from cluster.routing.affinity import ReplicaLoad

        if self.indexer is not None:
            self.indexer.catch_up(self.policy, now)
        for k, log in enumerate(self.logs or () if self.indexer is None else ()):
            epoch, after = self.cursors[k]
            page = log.since(after, epoch, limit=1 << 30)
            self.policy.apply_kv_page(f"r{k}", page, now)
            self.cursors[k] = (page.epoch, page.last_seq)
        loads = [
            ReplicaLoad(
                f"r{k}",
                e.num_running + e.num_waiting,
                e.num_waiting,
                e.kv_usage(),
                True,
                64,
                e.kv.pool.num_blocks,
            )
            for k, e in enumerate(engines)
        ]
        sid = self.specs[i].session_id
        d = self.policy.decide(self.hashes[i], loads, self.rng, now, sid)
        self.policy.record(d.replica, self.hashes[i], now, sid)
        k = int(d.replica[1:])
        if self.logs:  # the replica announces the arrival (deployments/engine/engine.py)
            from cluster.engine.kv_events import BlocksQueued

            self.logs[k].append([BlocksQueued(self.hashes[i], sid)], now)
        return k, self.policy.cache_rank(d)  # one surface: the engine's key is the cache rank


class _IndexerFeed:
    """Issue 42's indexer design on the virtual clock (cluster/routing/index_mirror.py): ``shards``
    indexers take every engine's pages; before each decision a gateway applies the frames it has
    not applied yet (as the feed does, without its lag). The gateways' routers only mirror."""

    def __init__(self, make_router: Callable[[], Any], logs: Sequence[Any], shards: int) -> None:
        from cluster.routing.index_mirror import FrameBuilder

        self.builders = [FrameBuilder(make_router(), s, shards) for s in range(shards)]
        self.logs = logs
        self.cursors: list[tuple[int | None, int]] = [(None, 0)] * len(logs)
        self.frames: list[Any] = []
        self.applied: dict[int, int] = {}  # id(a gateway's router) -> frames it applied

    def catch_up(self, policy: Any, now: float) -> None:
        for k, log in enumerate(self.logs):
            epoch, after = self.cursors[k]
            page = log.since(after, epoch, limit=1 << 30)
            for b in self.builders:
                b.take(f"r{k}", page, now)
            self.cursors[k] = (page.epoch, page.last_seq)
        for b in self.builders:
            frame = b.flush(now)
            if frame is not None:
                self.frames.append(frame)
        for frame in self.frames[self.applied.get(id(policy), 0) :]:
            policy.apply_frame(frame, now)
        self.applied[id(policy)] = len(self.frames)


class _Gateways:
    """Several gateway replicas on the virtual clock: requests alternate between them (HAProxy's
    leastconn over equally busy gateways); each has its own policy object (sessions, recent sends)
    and applies the same engines' events."""

    def __init__(self, choices: Sequence[_AffinityChoice]) -> None:
        self.choices = choices
        self.n = 0

    def __call__(self, i: int, engines: Sequence[Any], now: float) -> int | tuple[int, int]:
        self.n += 1
        return self.choices[self.n % len(self.choices)](i, engines, now)


def _engines(
    profile: Any, n: int, events: bool, policy: str = "priority"
) -> tuple[list[Any], list[Any] | None]:
    """n simulated engines, in the config's default queue order (``priority``: the surface's, then
    the cache rank) unless told otherwise; with ``events`` each publishes into its own KV-event log."""
    from cluster.engine.kv_events import KVEventLog
    from cluster.engine.model import EngineModel

    if not events:
        return [EngineModel(profile, scheduling_policy=policy) for _ in range(n)], None
    logs = [KVEventLog(epoch=k) for k in range(n)]
    engines = [
        EngineModel(
            profile, scheduling_policy=policy, on_kv_events=lambda ev, end, log=log: log.append(ev, end)
        )
        for log in logs
    ]
    return engines, logs


class _RayPrefixEmulation:
    """Ray's PrefixCacheAffinityRouter with its defaults, on characters: the replicas with the
    longest prefix match when it covers >= 10 % of the text, else the replicas with the fewest
    characters in their tree; among those the shortest queue; load is otherwise ignored."""

    def __init__(self, specs: Sequence[RequestSpec], n: int) -> None:
        self.texts = ["".join(m["content"] for m in s.messages) for s in specs]
        self.seen: list[list[str]] = [[] for _ in range(n)]
        self.chars = [0] * n

    @staticmethod
    def _lcp(a: str, b: str) -> int:
        lo, hi = 0, min(len(a), len(b))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def __call__(self, i: int, engines: Sequence[Any], now: float) -> int:
        t = self.texts[i]
        match = [max((self._lcp(t, x) for x in seen), default=0) for seen in self.seen]
        best = max(match)
        if best / len(t) >= 0.1:
            cands = [k for k, m in enumerate(match) if m == best]
        else:
            cands = [k for k, c in enumerate(self.chars) if c == min(self.chars)]
        k = min(cands, key=lambda k: (engines[k].num_running + engines[k].num_waiting, k))
        self.chars[k] += len(t) - match[k]
        self.seen[k].append(t)
        return k


# Issue 17 item 2: the new-prefix placements compared by config, each named whichever is the
# default (``cache_aware`` is ours as the config ships it): the least loaded eligible replica, or
# the context's sticky home with new contexts packed by hot working set per KV block.
PLACEMENTS: dict[str, dict[str, Any]] = {
    "least_loaded": {"new_prefix": "least_loaded"},
    "home": {"new_prefix": "home"},
}
# Also measured on the other seeds: ours without the cache rank (the engine orders by surface and
# arrival alone), which is how every run before it was made.
NO_RANK = {"new_prefix": "home", "cache_priority": False}
SEED_VARIANTS: dict[str, dict[str, Any]] = {**PLACEMENTS, "home, no cache priority": NO_RANK}
RAY_ENGINE_POLICY = "fcfs"  # vLLM's default order, as Ray Serve LLM deploys the engines
WHATIF = {  # name -> (affinity config, fed by KV events)
    "previous (routed records)": ({**PREVIOUS_AFFINITY, "kv_events": False}, False),
    "previous (kv events)": (PREVIOUS_AFFINITY, True),
    "cache_aware (routed records)": ({"kv_events": False}, False),
    "cache_aware (kv events)": ({}, True),
    "cache_aware, no cache priority (kv events)": ({"cache_priority": False}, True),
    **{f"new_prefix {k} (kv events)": (v, True) for k, v in PLACEMENTS.items()},
}
TWO_GATEWAYS = {"cache_aware": {}, **{f"new_prefix {k}": v for k, v in PLACEMENTS.items()}}


TIE_SEEDS = 5  # our policy breaks load ties with a seeded generator: one seed is one path of many


def _replay_ours(
    specs: Sequence[RequestSpec],
    token_ids: Sequence[list[int]],
    args: argparse.Namespace,
    affinity: dict[str, Any],
    events: bool,
    gateways: int,
    indexer_shards: int = 0,
) -> dict[str, Any]:
    """Ours on the virtual clock, once per tie-break seed: the first seed's figures, plus every
    seed's hit rate and TTFT p90 and their means (single seeds swing by a few points here).
    ``indexer_shards`` > 0: the gateways mirror that many indexers (issue 42) instead of applying
    the engines' pages themselves."""
    from cluster.routing.affinity import AffinityRouter
    from cluster.routing.event_hashes import RouterHashes

    profile = sim_profile(args)
    runs = []
    for seed in range(TIE_SEEDS):
        engines, logs = _engines(profile, args.replicas, events)
        choices = []

        def router() -> AffinityRouter:
            return AffinityRouter(profile.engine.block_size, MODEL, affinity_params(affinity))

        feed = _IndexerFeed(router, logs, indexer_shards) if indexer_shards and logs else None
        for g in range(gateways):
            policy = router()
            if feed is not None:  # every replica's entries come from the indexer's events
                policy.event_fed.update(f"r{k}" for k in range(args.replicas))
            choices.append(_AffinityChoice(policy, specs, token_ids, logs, feed))
            choices[-1].rng = random.Random(seed * 100 + g)
        for log in logs or ():  # what the engine replica publishes: its anchors in the router's hashes
            stride = choices[0].policy.params.claim_stride_blocks
            log.translate = RouterHashes(choices[0].policy.hasher, stride=stride).translate
        runs.append(simulate(specs, token_ids, engines, _Gateways(choices), args.speedup))
    hits = [r["hit_rate"] for r in runs]
    p90s = [r["ttft_p90_sim_ms"] for r in runs]
    return {
        **runs[0],
        "hit_rate_per_tie_seed": hits,
        "hit_rate_mean": round(sum(hits) / len(hits), 4),
        "ttft_p90_sim_ms_per_tie_seed": p90s,
        "ttft_p90_sim_ms_mean": round(sum(p90s) / len(p90s), 1),
    }


def whatif(specs: Sequence[RequestSpec], token_ids: Sequence[list[int]], args: argparse.Namespace) -> Any:
    """The same replay on the virtual clock through N engines: ours as shipped and as before issue
    17, with and without the engines' KV events, behind one and two gateway replicas (the real
    policy code, :data:`TIE_SEEDS` tie-break seeds each), and an emulation of Ray's prefix router."""
    out: dict[str, Any] = {}
    for name, (affinity, events) in WHATIF.items():
        out[name] = _replay_ours(specs, token_ids, args, affinity, events, 1)
    for name, affinity in TWO_GATEWAYS.items():
        out[f"{name} (kv events, 2 gateways)"] = _replay_ours(specs, token_ids, args, affinity, True, 2)
    # issue 42's indexer design: the same two gateways mirroring two indexer shards
    out["cache_aware (kv events, 2 gateways, indexer)"] = _replay_ours(specs, token_ids, args, {}, True, 2, 2)
    engines, _ = _engines(sim_profile(args), args.replicas, False, RAY_ENGINE_POLICY)
    out["ray_prefix (emulated)"] = simulate(
        specs, token_ids, engines, _RayPrefixEmulation(specs, args.replicas), args.speedup
    )
    return out


def other_seeds(args: argparse.Namespace, tok: Any) -> dict[str, Any] | None:
    """The placements and Ray's emulation on other workload seeds (``--extra-seeds``): one workload
    is one draw of which groups are hot and when they come, and a placement's edge on it can be
    that draw's luck; ours as a mean over the tie-break seeds, as in the what-if."""
    if not args.extra_seeds:
        return None
    rows: dict[str, Any] = {}
    for seed in args.extra_seeds:
        specs = workload(args).generate(seed)
        ids = [tok.chat_ids(list(s.messages)) for s in specs]
        row: dict[str, Any] = {"oracle_hit_rate": oracle(specs, ids, args)["hit_rate"]}
        for k, v in SEED_VARIANTS.items():
            r = _replay_ours(specs, ids, args, v, True, 1)
            row[k] = {"hit_rate": r["hit_rate_mean"], "ttft_p90_sim_ms": r["ttft_p90_sim_ms_mean"]}
        engines, _ = _engines(sim_profile(args), args.replicas, False, RAY_ENGINE_POLICY)
        ray = simulate(specs, ids, engines, _RayPrefixEmulation(specs, args.replicas), args.speedup)
        row["ray_prefix (emulated)"] = {
            "hit_rate": ray["hit_rate"],
            "ttft_p90_sim_ms": ray["ttft_p90_sim_ms"],
        }
        rows[str(seed)] = row
    names = [*SEED_VARIANTS, "ray_prefix (emulated)"]
    mean = {
        n: {
            m: round(sum(r[n][m] for r in rows.values()) / len(rows), 4)
            for m in ("hit_rate", "ttft_p90_sim_ms")
        }
        for n in names
    }
    mean["oracle_hit_rate"] = round(sum(r["oracle_hit_rate"] for r in rows.values()) / len(rows), 4)
    print(f"[{args.scenario}] other workload seeds {args.extra_seeds}, means: {json.dumps(mean)}", flush=True)
    return {"seeds": args.extra_seeds, "per_seed": rows, "mean": mean}


# --------------------------------------------------------------------------------------------


def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--scenario",
        default="groups",
        help=f"comma-separated, run one after the other: {', '.join(SCENARIOS)}",
    )
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="KV cache per replica, in tokens (default: the scenario's, or 32768)",
    )
    ap.add_argument(
        "--offline", action="store_true", help="only the oracle and the virtual-clock what-if (no Ray)"
    )
    ap.add_argument("--speedup", type=float, default=0.05, help="simulated seconds per wall second")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per wall second (Poisson)")
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=2, help="sessions per group (on average)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of sessions per group")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--extra-seeds",
        default="",
        help="comma-separated workload seeds to replay too, on the virtual clock (placements and Ray's)",
    )
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)}",
    )
    ap.add_argument(
        "--mode",
        choices=("concurrent", "sequential"),
        default="sequential",
        help="all policies' apps at once on the same schedule, or one app after the other",
    )
    ap.add_argument("--merge", action="store_true", help="keep the scenario's other policies' results")
    ap.add_argument("--port", type=int, default=0, help="Serve HTTP port (0: a free one)")
    ap.add_argument("--quick", action="store_true", help="a smaller workload (smoke run)")
    ap.add_argument("--out", default=str(RESULTS / "affinity.json"))
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = _arg_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.groups, args.sessions, args.turns = 8, 2, 2
    args.scenarios = [x for x in args.scenario.split(",") if x]
    args.extra_seeds = [int(x) for x in args.extra_seeds.split(",") if x]
    bad = set(args.scenarios) - set(SCENARIOS)
    if bad or not args.scenarios:
        ap.error(f"unknown scenarios: {sorted(bad)} (from {', '.join(SCENARIOS)})")
    args.kv_tokens_arg = args.kv_tokens
    args.policy_list = [p for p in args.policies.split(",") if p]
    dropped = set(args.policy_list) & DROPPED
    if dropped:
        ap.error(f"{sorted(dropped)}: no longer deployable on the gateway data plane (see POLICIES)")
    unknown = set(args.policy_list) - {*POLICIES, *VARIANTS}
    if unknown:
        ap.error(f"unknown policies: {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Worker processes of a busy shared machine can take minutes to start (Ray gives them 60 s).
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "600")
    from deployments.launcher import local

    # One port for every scenario of this run: the first scenario's Serve keeps serving the later
    # ones (serve.start ignores a new port), so a fresh port per scenario waited for an app on a
    # port nobody served (bench_all --full, 2026-12-02: common-prompt after groups, rc 1 after 10 min).
    args.port = args.port or _free_port()
    try:
        for scenario in args.scenarios:
            args.scenario = scenario
            args.kv_tokens = args.kv_tokens_arg or SCENARIO_KV_TOKENS.get(scenario, 32768)
            run_scenario(args, argv)
    finally:
        if not args.offline:
            local.stop()
    return 0


def run_scenario(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    from loadtest.common.provenance import git_state, provenance

    t_start, started, git, load_before = time.perf_counter(), time.monotonic(), git_state(), os.getloadavg()
    wl = workload(args)
    specs = wl.generate(args.seed)
    from cluster import tokens

    tok = tokens.load("@tiny")
    token_ids = [tok.chat_ids(list(s.messages)) for s in specs]
    orc = oracle(specs, token_ids, args)
    offline = whatif(specs, token_ids, args)
    print(f"[{args.scenario}] oracle hit rate {orc['hit_rate']}; virtual-clock what-if:", flush=True)
    for name, r in offline.items():
        mean = f" (mean of {TIE_SEEDS} tie seeds {r['hit_rate_mean']})" if "hit_rate_mean" in r else ""
        print(f"  {name:48s} hit {r['hit_rate']}{mean}  ttft p90 {r['ttft_p90_sim_ms']} sim ms", flush=True)
    extra = other_seeds(args, tok)
    meta = machine()
    per_policy: dict[str, Any] = {}
    if not args.offline:
        port = args.port or _free_port()
        run = run_concurrent if args.mode == "concurrent" else run_sequential
        per_policy = run(args.policy_list, specs, args, port)
    meta["provenance"] = provenance(list(argv or sys.argv[1:]), git, load_before, started)
    per_policy = stamp_runs(per_policy, meta["provenance"])
    if extra:
        offline = {**offline, "other_workload_seeds": extra}
    write_report(args, wl, specs, token_ids, per_policy, orc, offline, meta, time.perf_counter() - t_start)


RUN_KEYS = ("git_commit", "git_dirty", "timestamp", "load_average_before", "load_average_after")


def stamp_runs(per_policy: dict[str, Any], prov: dict[str, Any]) -> dict[str, Any]:
    """Each policy's result with the run that measured it (commit, time, load), so that rows a
    later ``--merge`` keeps still say where they came from."""
    run = {k: prov.get(k) for k in RUN_KEYS}
    return {name: {**r, "run": run} for name, r in per_policy.items()}


def merge_policies(
    kept: dict[str, Any], workload: dict[str, Any], fresh: dict[str, Any]
) -> tuple[dict[str, Any], bool]:
    """The fresh policies over the kept scenario's, each row with its own ``run`` stamp; only when
    both ran the same workload (another size or seed would put unlike figures in one table):
    (policies, merged)."""
    if kept.get("workload") != workload:
        return fresh, False
    return {**kept.get("policies", {}), **fresh}, True


def write_report(
    args: argparse.Namespace,
    wl: SharedPrefixWorkload,
    specs: Sequence[RequestSpec],
    token_ids: Sequence[list[int]],
    per_policy: dict[str, Any],
    orc: dict[str, Any],
    offline: dict[str, Any],
    meta: dict[str, Any],
    runtime_s: float,
) -> None:
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    scenarios = old.get("scenarios", {})
    workload = {**wl.params(), **summary(specs)}
    if (args.merge or args.offline) and args.scenario in scenarios:
        per_policy, merged = merge_policies(scenarios[args.scenario], workload, per_policy)
        if not merged:
            print(f"[{args.scenario}] not merged: the file's policies ran another workload", flush=True)
    lens = sorted(len(t) for t in token_ids)
    entry = {
        "scenario": args.scenario,
        "policies": per_policy,
        "oracle_hit_rate": orc["hit_rate"],
        "oracle": orc,
        "goals": goals(per_policy, orc["hit_rate"], offline),
        "virtual_clock_whatif": offline,
        "setup": {
            "apps": (
                "one Serve app per policy in one Ray instance (llmc-aff-<policy> at /<policy>), fresh "
                "engines and caches each; "
                + (
                    "all deployed at once, the same schedule replayed against all at the same moment"
                    if args.mode == "concurrent"
                    else "deployed one after the other, each deleted before the next"
                )
            ),
            "mode": args.mode,
            "profile": PROFILE,
            "replicas": args.replicas,
            "kv_tokens_per_replica": args.kv_tokens,
            "speedup": args.speedup,
            "rate_per_wall_s": args.rate,
            "rate_per_sim_s": round(args.rate / args.speedup, 2),
            "closed_loop_sessions": True,
            "session_header": "x-session-id on every request",
            "seed": args.seed,
            "prompt_tokens": {"p50": lens[len(lens) // 2], "max": lens[-1]},
            "ttft": "client side, send -> first content chunk; *_ms wall clock, *_sim_ms = wall x speedup",
        },
        "workload": workload,
        "machine": meta,
        "runtime_s": round(runtime_s, 1),
    }
    scenarios[args.scenario] = entry
    report = {"benchmark": "affinity", **scenarios.get("groups", entry), "scenarios": scenarios}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(entry["goals"], indent=2))
    print(f"wrote {out} ({args.scenario}) in {runtime_s:.0f} s")


def goals(
    per_policy: dict[str, Any], oracle_rate: float, offline: dict[str, Any] | None = None
) -> dict[str, Any]:
    ours, ray_ = per_policy.get("cache_aware"), per_policy.get("ray_prefix")
    g: dict[str, Any] = {}
    if ours and ours.get("hit_rate") is not None and oracle_rate:
        ratio = ours["hit_rate"] / oracle_rate
        g["hit_rate_vs_oracle"] = round(ratio, 3)
        g["hit_rate_goal_met"] = ratio >= 0.95
    if ours and ray_ and ours.get("ttft_p90_ms") and ray_.get("ttft_p90_ms"):
        ratio = ray_["ttft_p90_ms"] / ours["ttft_p90_ms"]
        g["ttft_p90_ray_over_ours"] = round(ratio, 3)
        g["ttft_goal_met"] = ratio >= 1.3
    v_ours = (offline or {}).get("cache_aware (kv events)")
    v_ray = (offline or {}).get("ray_prefix (emulated)")
    v_two = (offline or {}).get("cache_aware (kv events, 2 gateways)")
    if v_ours and v_ray:
        hit, p90 = v_ours.get("hit_rate_mean", v_ours["hit_rate"]), v_ours.get("ttft_p90_sim_ms_mean")
        g["virtual_clock"] = {
            "basis": f"ours: mean over {TIE_SEEDS} tie-break seeds; Ray: its emulation",
            "hit_rate_vs_oracle": round(hit / oracle_rate, 3) if oracle_rate else None,
            "hit_rate_minus_ray": round(hit - v_ray["hit_rate"], 4),
            "ttft_p90_ray_over_ours": round(v_ray["ttft_p90_sim_ms"] / p90, 3) if p90 else None,
        }
        if v_two:
            g["virtual_clock"]["two_gateways_minus_one"] = round(v_two["hit_rate_mean"] - hit, 4)
        g["virtual_clock"]["placements"] = _placement_goals(offline or {}, v_ray, oracle_rate)
    return g


def _placement_goals(offline: dict[str, Any], v_ray: dict[str, Any], oracle_rate: float) -> dict[str, Any]:
    """Each new-prefix placement against the goals, whichever is the default (item 2's what-if)."""
    out: dict[str, Any] = {}
    for k in PLACEMENTS:
        one, two = (
            offline.get(f"new_prefix {k} (kv events)"),
            offline.get(f"new_prefix {k} (kv events, 2 gateways)"),
        )
        if not one:
            continue
        hit, p90 = one["hit_rate_mean"], one["ttft_p90_sim_ms_mean"]
        out[k] = {
            "hit_rate_mean": hit,
            "hit_rate_vs_oracle": round(hit / oracle_rate, 3) if oracle_rate else None,
            "hit_rate_minus_ray": round(hit - v_ray["hit_rate"], 4),
            "ttft_p90_sim_ms_mean": p90,
            "ttft_p90_ray_over_ours": round(v_ray["ttft_p90_sim_ms"] / p90, 3) if p90 else None,
            "two_gateways_minus_one": round(two["hit_rate_mean"] - hit, 4) if two else None,
        }
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
