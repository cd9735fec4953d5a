"""Soak: a steady, moderate load of mixed surfaces for a while, watching every Ray actor of the app
(its gateway and engine replicas, Serve's controller and proxy, the provider budgets) for growth:
resident memory (psutil on the actor's PID, which the actor reports through ``__ray_call__``), open
inet sockets and file descriptors, the asyncio tasks on each Serve replica's user-code event loop,
and each gateway replica's tables (its routing views and provider adapters' per-request entries).

Baseline and end are read at rest (nothing in flight), after a warm-up that fills the pools and
caches; the samples in between give each actor's RSS trend. The CI tier runs 1-2 minutes
(tests/reliability/test_soak.py); by hand, ten:

    .venv/bin/python -m loadtest.benchmarks.soak [--minutes 10] [--out loadtest/results/soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.common.actor_probe import actor_snapshot, wait_idle
from loadtest.common.provenance import git_state, provenance
from loadtest.common.reliability import MIX_SHAPES, Keys, Load, loopback_app

RESULTS = Path(__file__).parents[1] / "results"
# An engine replica's token server (aiohttp) runs one task per open connection: the gateways keep
# their connections to it alive between requests (their pools), so at rest each idle pooled
# connection has its task. Those are counted apart, against the connections the server holds.
CONNECTION_TASK = "RequestHandler.start"


def counted_tasks(actor: dict[str, Any], when: str) -> int:
    """An actor's tasks at ``when`` ("start" or "end") as the leak check counts them."""
    return actor.get(f"request_tasks_{when}", actor[f"tasks_{when}"])


def request_tasks(snap: dict[str, Any]) -> int:
    """The actor's tasks other than an engine's idle keep-alive connections' own."""
    if "engine" not in snap:
        return snap["tasks"]
    return snap["tasks"] - snap["task_names"].get(CONNECTION_TASK, 0)


def _idle(app: str, timeout: float = 30.0) -> dict[str, Any]:
    """Counters once the gateways are idle, then a moment for the backends to finish their aborts."""
    counters = wait_idle(app, timeout)
    time.sleep(1.5)
    return counters


def _settled(snap: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Each actor's counted tasks, or -1 for an engine replica that still has a stream open."""
    out = {}
    for name, a in snap.items():
        e = a.get("engine")
        busy = e is not None and (e["ongoing"], e["running"], e["waiting"]) != (0, 0, 0)
        out[name] = -1 if busy else request_tasks(a)
    return out


def at_rest(app: str, timeout: float = 20.0) -> tuple[dict[str, dict[str, Any]], float]:
    """A snapshot of every actor once none is still winding down, and how long that took.

    After the gateways are idle an engine may still be aborting a stream a client left, and a
    replica may still be finishing a fire-and-forget settlement. A CI run on a 2-core box once
    counted 4 tasks more at the end than at the start, in an actor its message cut off (not seen
    here in 3 runs, so which tasks is not known); one fixed pause cannot tell a slow ending from a
    leak. So read until every engine's streams are closed and two reads a second apart count the
    same tasks per actor; a task that never ends still shows after ``timeout``: that is the leak."""
    t0 = time.monotonic()
    snap = actor_snapshot(app)
    while time.monotonic() - t0 < timeout:
        time.sleep(1.0)
        again = actor_snapshot(app)
        counts = _settled(again)
        if counts == _settled(snap) and -1 not in counts.values():
            return again, round(time.monotonic() - t0, 1)
        snap = again
    return snap, round(time.monotonic() - t0, 1)


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if den == 0 else 60 * sum((t - mt) * (v - mv) for t, v in samples) / den


def _compare(
    b: dict[str, Any] | None, e: dict[str, Any] | None, pts: list[tuple[float, float]]
) -> dict[str, Any]:
    """One actor at rest before and after the load: memory, tasks, sockets, its own tables."""
    if b is None or e is None:
        return {"present": "end only" if b is None else "start only"}
    out: dict[str, Any] = {
        "rss_start_mb": round(b["rss_mb"], 1),
        "rss_end_mb": round(e["rss_mb"], 1),
        "rss_growth_mb": round(e["rss_mb"] - b["rss_mb"], 1),
        "rss_peak_mb": round(max(v for _, v in pts), 1) if pts else None,
        "rss_slope_mb_per_min": round(slope_mb_per_min(pts[len(pts) // 2 :]), 2),
        "tasks_start": b["tasks"],
        "tasks_end": e["tasks"],
        "sockets_start": b["sockets"],
        "sockets_end": e["sockets"],
        "fds_start": b["fds"],
        "fds_end": e["fds"],
        "gc_objects_start": b["gc_objects"],
        "gc_objects_end": e["gc_objects"],
    }
    if "views" in e:  # a gateway replica: its routing views' and adapters' tables
        out["routing_tables_start"] = b.get("views")
        out["routing_tables_end"] = e["views"]
        out["provider_flights_end"] = {k: v["flights"] for k, v in e["providers"].items()}
    if "engine" in e:  # an engine replica: its streams, and its idle connections' tasks
        out["engine_end"] = e["engine"]
        out["request_tasks_start"] = request_tasks(b)
        out["request_tasks_end"] = request_tasks(e)
        out["connection_tasks_start"] = b["task_names"].get(CONNECTION_TASK, 0)
        out["connection_tasks_end"] = e["task_names"].get(CONNECTION_TASK, 0)
        out["connections_start"] = b["engine"]["connections"]
        out["connections_end"] = e["engine"]["connections"]
    new = Counter(e["task_names"]) - Counter(b["task_names"])
    if new:  # by name: which kind of task there is more of at the end
        out["new_tasks"] = dict(new)
    return out


def _sample_rss(
    app: str, series: dict[str, list[tuple[float, float]]], t0: float, duration_s: float, every_s: float
) -> None:
    """Every actor's RSS every ``every_s`` until ``duration_s`` after ``t0``, into ``series``."""
    while time.monotonic() - t0 < duration_s:
        time.sleep(min(every_s, max(0.0, duration_s - (time.monotonic() - t0))))
        t = time.monotonic() - t0
        for name, v in actor_snapshot(app).items():
            series.setdefault(name, []).append((t, v["rss_mb"]))


def run_soak(
    app: str,
    base_url: str,
    keys: Keys,
    *,
    duration_s: float,
    warmup_s: float = 10.0,
    workers: int = 4,
    think_s: float = 0.1,
    sample_every_s: float = 5.0,
    rest_s: float = 0.0,
) -> dict[str, Any]:
    """``rest_s``: how long to wait, once idle, before each at-rest snapshot. Past the pools'
    keep-alive expiry (30 s: the gateway's connections to engines and providers) the idle pooled
    connections have closed too, so the sockets at rest should match exactly; with 0 they count."""
    # Warm-up: pools, caches, lazily built things; then the baseline at rest.
    with Load(base_url, keys, workers=workers, think_s=think_s, max_s=warmup_s, shapes=MIX_SHAPES, seed=1):
        time.sleep(warmup_s)
    _idle(app)
    time.sleep(rest_s)
    base, settle_start_s = at_rest(app)
    series: dict[str, list[tuple[float, float]]] = {k: [(0.0, v["rss_mb"])] for k, v in base.items()}
    t0 = time.monotonic()
    load = Load(
        base_url,
        keys,
        workers=workers,
        think_s=think_s,
        max_s=duration_s,
        max_requests=int(duration_s * 50),
        shapes=MIX_SHAPES,
        seed=2,
    )
    with load:
        _sample_rss(app, series, t0, duration_s, sample_every_s)
    records = load.snapshot()
    counters = _idle(app)
    time.sleep(rest_s)
    end, settle_end_s = at_rest(app)
    actors = {
        name: _compare(base.get(name), end.get(name), series.get(name, []))
        for name in sorted(set(base) | set(end))
    }
    both = [a for a in actors.values() if "tasks_end" in a]
    return {
        "duration_s": round(time.monotonic() - t0, 1),
        "workers": workers,
        "rest_s": rest_s,
        "settle_s": {"start": settle_start_s, "end": settle_end_s},
        "requests": len(records),
        "rate_rps": round(len(records) / max(1e-9, time.monotonic() - t0), 2),
        "endings": dict(Counter(r.outcome if r.ended else "hung" for r in records)),
        "bad_error_shape": sum(1 for r in records if not r.shape_ok),
        # Every task but an engine's connection tasks (those are checked against its connections).
        "leaked_tasks": sum(max(0, counted_tasks(a, "end") - counted_tasks(a, "start")) for a in both),
        "leaked_sockets": sum(max(0, a["sockets_end"] - a["sockets_start"]) for a in both),
        "rss_growth_mb": {k: a["rss_growth_mb"] for k, a in actors.items() if "rss_growth_mb" in a},
        "actors": actors,
        "gateway_counters": counters,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rest", type=float, default=35.0, help="seconds at rest before each snapshot")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    args = p.parse_args(argv)

    git, load0, t0 = git_state(), os.getloadavg(), time.monotonic()
    with loopback_app("llmc-soak", "/soak") as app:
        out = run_soak(
            app.cfg.name,
            app.base_url,
            app.keys,
            duration_s=args.minutes * 60,
            workers=args.workers,
            sample_every_s=15,
            rest_s=args.rest,
        )
    out["provenance"] = provenance(argv or sys.argv[1:], git, load0, t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("actors", "gateway_counters")}, indent=2))


if __name__ == "__main__":
    main()
