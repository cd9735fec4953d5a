"""Tab kept off replicas mid-prefill (a surface's ``avoid_prefill_tokens``), on the virtual clock:
the gateway's own routing view (:class:`cluster.routing.view.BackendView`, the code the gateway runs)
deciding for simulated engines (:class:`cluster.engine.model.EngineModel`, Llama-3.1-8B on H100s,
1,024-token prefill chunks, the priority policy), with the threshold and without, in one run.

    python -m loadtest.benchmarks.bench_prefill_avoid   # ~1 minute; loadtest/results/prefill_avoid.json

Why a virtual clock: the effect is a matter of which engine step a Tab prompt lands in (a step
holding a long prefill chunk takes ~25 ms on this profile, one of decodes a few), which the engine
model times exactly and a live run on two shared cores buries in its own noise (BENCHMARKS.md, the
noisy neighbour: ~110 Tab requests a phase, its p99 their second slowest).

Two workloads (``WORKLOADS``), Tab at ``--tab-rate`` and Agent at each of its rates (requests/s,
Poisson), for ``--duration-s`` virtual seconds, over ``--seeds``:

* ``shared``: the shapes of :data:`loadtest.benchmarks.bench_overload.SHAPES`, as the live shared-pool
  benchmarks send them: Agent ~2.9k-token prompts in 8 repositories, ~90 % of their tokens cached
  once warm (the uncached part of a prompt is a few hundred tokens);
* ``long_context``: Agent as an agent over a repository reads it: 64 repositories, 3,000 words of
  context (~5k-token prompts), about half of Agent's tokens uncached: long prefills are common.

Tab is the same in both (~900-token prompts in 8 repositories). Three engine replicas; one
gateway, or two that take requests in turn (each view counts only its own attempts, as in the
cluster). Every view follows every engine's KV events before it decides and each chosen replica
announces its request (``BlocksQueued``), as the gateways' feed does (here without its lag, which
is up to ``deployments.gateway.kv_feed.MIN_POLL_S``); a view learns of its own attempt's first token at its
next decision after it. Variants: ``off``; ``on_N`` per threshold N of ``--thresholds``; and with
two gateways the what-ifs ``shared_Ss`` (the first threshold, and every view also given each
engine's own count of its prefilling tokens, all gateways' requests, every S seconds of
``--share-every``: how fresh a cluster-wide signal would have to be). Per variant: Tab's and
Agent's TTFT p50 / p99 (virtual ms), their output tokens, the prefix-cache hit rate, and how many
decisions skipped a replica for its prefill. The prediction this checks: Tab's p99 falls where
Agent's prefills are long, Agent's output and the hit rate stay where they were, and where Agent's
prefills are short the threshold changes nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.kv_events import BlocksQueued, KVEventLog
from cluster.engine.model import EngineModel
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityRouter
from cluster.routing.view import BackendView, ReplicaInfo
from loadtest.benchmarks.bench_overload import PROFILE, SHAPES, workloads
from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import RESULTS, machine, ms, percentile

OUT = RESULTS / "prefill_avoid.json"
ENGINES = 3
CHUNK = 1024  # configs/sim-local.yaml's max_num_batched_tokens
THRESHOLD = 512  # the shipped configs' Tab avoid_prefill_tokens
SURFACE_PRIORITY = {"tab": 0, "chat": 1, "agent": 2}  # configs/sim-local.yaml's
LONG_AGENT = {**SHAPES["agent"], "num_groups": 64, "context_words": 3000}
# name: (shapes, Agent's rates per second)
WORKLOADS: dict[str, tuple[dict[str, dict[str, int]], tuple[float, ...]]] = {
    "shared": (SHAPES, (3.5, 7.0, 11.0)),
    "long_context": ({**SHAPES, "agent": LONG_AGENT}, (2.0, 4.0, 6.0)),
}


@dataclass
class _Sent:
    view: Any
    choice: Any
    req: Any  # the engine's SimRequest
    prefilled: bool = False


def profile() -> Any:
    from cluster.engine.profiles import get_profile

    return get_profile(PROFILE).with_engine(max_num_batched_tokens=CHUNK, max_model_len=8192)


def _feed_back(sent: list[_Sent], now: float) -> list[_Sent]:
    """What the gateways learn by ``now``: first tokens (:meth:`BackendView.prefilled`) and ends."""
    left = []
    for s in sent:
        if not s.prefilled and s.req.first_token_time is not None and s.req.first_token_time <= now:
            s.view.prefilled(s.choice)
            s.prefilled = True
        if s.req.finish_time is not None and s.req.finish_time <= now:
            s.view.ended(s.choice.replica, s.choice)
        else:
            left.append(s)
    return left


def engine_prefill(engine: Any) -> int:
    """A simulated engine's own count: prompt tokens of its requests without a first token that
    are neither computed nor cached (what an engine could publish to every gateway)."""
    return sum(
        max(0, r.prompt_len - max(r.num_computed_tokens, r.num_cached_tokens))
        for r in (*engine.running, *engine.waiting)
        if r.first_token_time is None
    )


@dataclass
class _InformedView(BackendView):
    """A what-if view that also knows each replica's prefilling tokens as its engine last shared
    them (``shared``: every gateway's requests), taking the larger of that and its own count."""

    shared: dict[str, int] = field(default_factory=dict)

    def _busy_prefill(self) -> Mapping[str, int]:
        own = super()._busy_prefill()
        both = set(own) | set(self.shared)
        return Counter({r: max(own.get(r, 0), self.shared.get(r, 0)) for r in both})


def _follow_events(view: Any, logs: Sequence[KVEventLog], cursors: list[tuple[int, int]], now: float) -> None:
    """One view reads every engine's KV events since its cursors (advanced in place)."""
    for k, log in enumerate(logs):
        page = log.since(cursors[k][1], cursors[k][0], limit=1 << 30)
        view.apply_kv_page(f"r{k}", page, now)
        cursors[k] = (page.epoch, page.last_seq)


def replay(
    specs: Sequence[RequestSpec],
    token_ids: Sequence[list[int]],
    threshold: int | None,
    gateways: int,
    share_every: float | None = None,
) -> dict[str, Any]:
    """One variant: the requests routed by ``gateways`` views in turn onto fresh engines. Every
    view follows every engine's KV events before it decides (the gateways' feed, without its lag)
    and the chosen replica announces each request (``BlocksQueued``), as in the cluster.
    ``share_every``: a what-if, each engine's own prefill count (:func:`engine_prefill`) given to
    every view at the first decision ``share_every`` seconds after the last (0: at each one)."""
    prof = profile()
    logs = [KVEventLog(max_batches=1 << 20, epoch=k) for k in range(ENGINES)]
    engines = [
        EngineModel(
            prof, scheduling_policy="priority", on_kv_events=lambda ev, end, log=log: log.append(ev, end)
        )
        for log in logs
    ]
    make = BackendView if share_every is None else _InformedView
    views = [
        make("sim", AffinityRouter(prof.engine.block_size, "m"), ReplicaEjector(), 64)
        for _ in range(gateways)
    ]
    cursors = [[(k, 0) for k in range(ENGINES)] for _ in views]
    sent: list[_Sent] = []
    done: list[tuple[str, Any]] = []
    shared_at = -math.inf
    for n, (spec, ids) in enumerate(zip(specs, token_ids, strict=True)):
        now = spec.arrival_s
        for e in engines:
            e.run_until(now)
        sent = _feed_back(sent, now)
        if share_every is not None and now >= shared_at + share_every:
            counts = {f"r{k}": engine_prefill(e) for k, e in enumerate(engines)}
            for v in views:
                v.shared = counts
            shared_at = now
        g = n % gateways
        view = views[g]
        view.sync(
            [ReplicaInfo(f"r{k}", "sim://", e.num_waiting, e.kv_usage()) for k, e in enumerate(engines)]
        )
        _follow_events(view, logs, cursors[g], now)
        hashes = view.policy.hash(ids)
        busy = threshold if spec.surface == "tab" else None
        choice = view.choose(hashes, now, spec.session_id, busy_prefill_tokens=busy)
        view.started(choice, hashes, now, spec.session_id, len(ids))
        priority = 2 * SURFACE_PRIORITY[spec.surface or "chat"] + (1 if choice.cache_rank else 0)
        k = int(choice.replica[1:])
        req = engines[k].add_request(f"v{n}", ids, spec.max_tokens, arrival_time=now, priority=priority)
        logs[k].append([BlocksQueued(hashes, spec.session_id)], now)  # the replica announces it
        sent.append(_Sent(view, choice, req))
        done.append((spec.surface or "chat", req))
    for e in engines:
        e.run()
    return summarize(done, engines, sum(v.snapshot().avoided_prefill for v in views))


def summarize(done: Sequence[tuple[str, Any]], engines: Sequence[Any], avoided: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    end = max(e.now for e in engines)
    for surface in ("tab", "agent"):
        reqs = [r for s, r in done if s == surface]
        ttft = [r.ttft for r in reqs if r.ttft is not None]
        out[surface] = {
            "n": len(reqs),
            "output_tokens": sum(r.num_output_tokens for r in reqs),
            "ttft_p50_ms": ms(percentile(ttft, 50)),
            "ttft_p99_ms": ms(percentile(ttft, 99)),
            "output_tok_s": round(sum(r.num_output_tokens for r in reqs) / end, 1) if end else None,
        }
    queries = sum(e.counters.prefix_cache_queries for e in engines)
    hits = sum(e.counters.prefix_cache_hits for e in engines)
    out["hit_rate"] = round(hits / queries, 4) if queries else None
    out["avoided_prefill"] = avoided
    return out


def load(
    workload: str, tab_rate: float, agent_rate: float, duration_s: float, seed: int
) -> list[RequestSpec]:
    return workloads({"tab": tab_rate, "agent": agent_rate}, duration_s, seed, shapes=WORKLOADS[workload][0])


def _line(row: dict[str, Any]) -> str:
    """One load's variants on one line: Tab's p50/p99, decisions that avoided, Agent's tok/s, hits."""
    parts = [f"{row['workload']} agent {row['agent_rate']}/s seed {row['seed']} gateways {row['gateways']}:"]
    for name, v in row.items():
        if isinstance(v, dict):
            parts.append(
                f"{name} tab {v['tab']['ttft_p50_ms']}/{v['tab']['ttft_p99_ms']} ms"
                f" (avoided {v['avoided_prefill']}) agent {v['agent']['output_tok_s']} tok/s"
                f" hit {v['hit_rate']}"
            )
    return " | ".join(parts)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tab-rate", type=float, default=4.0)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--duration-s", type=float, default=60.0, help="virtual seconds per load")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--gateways", default="1,2")
    ap.add_argument("--thresholds", default=str(THRESHOLD), help="avoid_prefill_tokens, one variant each")
    ap.add_argument(
        "--share-every",
        default="0.5,0.1,0",
        help="what-ifs with several gateways: the engines' prefill counts shared this often (seconds)",
    )
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        ap.error(f"--workloads: one or more of {', '.join(WORKLOADS)}")
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.gateways = [int(x) for x in args.gateways.split(",")]
    args.thresholds = [int(x) for x in args.thresholds.split(",")]
    args.share_every = [float(x) for x in args.share_every.split(",") if x]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from cluster import tokens
    from loadtest.common.provenance import git_state, provenance, write_report

    args = parse_args(argv)
    git, load0, started = git_state(), os.getloadavg(), time.monotonic()
    tok = tokens.load("@tiny")
    runs: list[dict[str, Any]] = []
    for workload, rate, seed in [
        (w, r, k) for w in args.workloads for r in WORKLOADS[w][1] for k in args.seeds
    ]:
        specs = load(workload, args.tab_rate, rate, args.duration_s, seed)
        ids = [tok.chat_ids(list(s.messages)) for s in specs]
        for gw in args.gateways:
            row: dict[str, Any] = {"workload": workload, "agent_rate": rate, "seed": seed, "gateways": gw}
            row["off"] = replay(specs, ids, None, gw)
            for threshold in args.thresholds:
                row[f"on_{threshold}"] = replay(specs, ids, threshold, gw)
            for every in args.share_every if gw > 1 else ():  # what-ifs: the engines' counts shared
                row[f"shared_{every:g}s"] = replay(specs, ids, args.thresholds[0], gw, every)
            runs.append(row)
            print(_line(row), flush=True)
    report = {
        "benchmark": "prefill_avoid",
        "clock": "virtual",
        "profile": PROFILE,
        "engines": ENGINES,
        "chunk_tokens": CHUNK,
        "thresholds": args.thresholds,
        "tab_rate": args.tab_rate,
        "duration_s": args.duration_s,
        "machine": machine(),
        "runs": runs,
        "runtime_s": round(time.monotonic() - started, 1),
        "provenance": provenance(sys.argv[1:] if argv is None else argv, git, load0, started),
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
