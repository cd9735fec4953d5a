"""Soak (the CI length of ``loadtest/benchmarks/soak.py``; ``LLMC_LONG=1`` runs ten minutes): a steady
moderate load of mixed surfaces, then every actor of the app back at rest is compared with its baseline: no
asyncio task, socket or descriptor left behind, the gateways' per-request tables empty again (each
routing view's in-flight entries, each provider adapter's flights) and their other tables within
their bounds, no engine stream left open, resident memory within a small bound, and the counters
balanced."""

from __future__ import annotations

import json
import os

import pytest

from cluster.routing.affinity import REASONS
from loadtest.benchmarks.soak import counted_tasks, run_soak
from loadtest.common.reliability import ANTHROPIC_BACKEND, OPENAI_BACKEND, SIM_BACKEND, STALL_BACKEND

SELF_HOSTED = {SIM_BACKEND: 2, STALL_BACKEND: 1}  # backend -> replicas (reliability_config)
PROVIDERS = (OPENAI_BACKEND, ANTHROPIC_BACKEND)
SERVE_OWN = ("SERVE_CONTROLLER_ACTOR", "SERVE_PROXY_ACTOR")  # Ray Serve's actors, not our replicas

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

LONG = os.environ.get("LLMC_LONG") == "1"
DURATION_S = 600 if LONG else 30  # CI: 200-330 requests, enough for a leak per request to show
# Per actor, baseline at rest to end at rest. Measured: a gateway grows about 18 MB in 5 minutes
# (0.8-1.0 MB/min in the second half, both runs; its routing index and session tables fill up to
# their bounds, which these figures cannot tell from a slow leak); engines and Serve's actors 2-5 MB.
# A CI-length run cannot resolve 1 MB/min against that noise: loadtest/benchmarks/soak.py reports the slope.
RSS_BOUND_MB = 60 if LONG else 30
WORKERS = 4  # the load's concurrency


def sockets_bound(actor: str) -> int:
    """Sockets an actor may end with beyond its baseline when the snapshot takes no rest: its pooled,
    idle keep-alive connections, at most one per concurrent request to each peer. A gateway's peers
    are HAProxy in front and each engine replica and provider server behind; an engine's, the two
    gateways; Serve's own actors carry no request and keep the old bound. Measured (the soak*.json
    files, 5-minute runs of 2.5-10.6K requests): gateways +1 to +4, engines 0-3; one CI run at
    968cfb6 saw a gateway at +5. A leak per request would be hundreds: the CI run (30 s) sends 200-330."""
    if actor.startswith("Gateway"):
        return WORKERS * (1 + sum(SELF_HOSTED.values()) + len(PROVIDERS))
    if actor.startswith("backend-"):
        return WORKERS * 2
    return 4


@pytest.fixture(scope="module")
def soak(rel, tmp_path_factory):
    out = run_soak(
        rel.name, rel.base_url, rel.keys, duration_s=DURATION_S, warmup_s=5, workers=WORKERS, sample_every_s=5
    )
    (tmp_path_factory.mktemp("soak") / "soak.json").write_text(json.dumps(out, indent=2))
    print("\nsoak:", json.dumps({k: v for k, v in out.items() if k not in ("actors", "gateway_counters")}))
    return out


def test_every_request_ended_cleanly(soak) -> None:
    """Nobody hung or was cut off; an occasional upstream timeout on a loaded box is an OpenAI error."""
    ends = soak["endings"]
    assert set(ends) <= {"completed", "failed_over", "cancelled", "error_status", "error_event"}, ends
    assert ends.get("error_status", 0) + ends.get("error_event", 0) <= 0.01 * soak["requests"], ends
    assert soak["bad_error_shape"] == 0
    assert soak["requests"] > 100


def test_nothing_left_behind(soak) -> None:
    views_seen = 0
    grown = {  # only the actors that end with more tasks than they started with, and which tasks
        k: a.get("new_tasks")
        for k, a in soak["actors"].items()
        if "tasks_end" in a and counted_tasks(a, "end") > counted_tasks(a, "start")
    }
    assert soak["leaked_tasks"] == 0, grown
    for name, a in soak["actors"].items():
        if "tasks_end" not in a:
            continue
        # What is pooled is bounded by the peers (sockets_bound); every other descriptor stays.
        grew = a["sockets_end"] - a["sockets_start"]
        assert grew <= sockets_bound(name), (name, sockets_bound(name), a)
        # Serve's own actors (controller, proxies) get a margin of 2 other descriptors: in a full CI
        # run at load 30-40 the fallback proxy, which HAProxy mode leaves idle, ended with one more
        # non-socket descriptor than it started with (97 against 96; Ray's internals, not a request
        # of ours). Our replicas, which every request crosses, get none.
        margin = 2 if name.startswith(SERVE_OWN) else 0
        assert a["fds_end"] - a["fds_start"] <= max(grew, 0) + margin, (name, a)
        tables = a.get("routing_tables_end")
        if tables is not None:  # a gateway replica: its per-request entries are all forgotten at rest
            views_seen += 1
            assert set(tables) == set(SELF_HOSTED), (name, tables)
            for backend, t in tables.items():
                assert t["in_flight"] == 0 and t["in_flight_total"] == 0, (name, backend, t)
                # Per replica or per reason, not per request: bounded by the backend's replicas.
                assert t["live"] <= SELF_HOSTED[backend], (name, backend, t)
                assert t["decision_counts"] <= len(REASONS), (name, backend, t)
                assert t["index_replicas"] <= SELF_HOSTED[backend], (name, backend, t)
                assert t["index_blocks"] <= t["index_capacity"], (name, backend, t)
                assert t["sessions"] <= t["session_capacity"], (name, backend, t)
            flights = a["provider_flights_end"]
            assert set(flights) == set(PROVIDERS) and not any(flights.values()), (name, flights)
        engine = a.get("engine_end")
        if engine is not None:  # an engine replica: no stream left open
            assert (engine["ongoing"], engine["running"], engine["waiting"]) == (0, 0, 0), (name, engine)
            # Its token server runs a task per open connection, and the gateways keep theirs alive
            # between requests (pooled: how many depends on the load's peaks, not on a leak; their
            # sockets are bounded above). Each such task has its connection (none is orphaned),
            # and every other task is counted in leaked_tasks.
            for when in ("start", "end"):
                assert a[f"connection_tasks_{when}"] == a[f"connections_{when}"], (name, when, a)
    assert views_seen >= 1, sorted(soak["actors"])  # the gateways were looked at


def test_memory_stays_within_bounds(soak) -> None:
    grown = {k: v for k, v in soak["rss_growth_mb"].items() if v > RSS_BOUND_MB}
    assert grown == {}, grown


def test_counters_balance(soak) -> None:
    assert soak["gateway_counters"]
    for c in soak["gateway_counters"].values():
        assert c["balanced"] and c["in_flight"] == 0 and c["double_release"] == 0, c
