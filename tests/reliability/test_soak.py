"""Soak (the CI length of ``loadtest/soak.py``; ``LLMC_LONG=1`` runs ten minutes): a steady moderate
load of mixed surfaces, then every actor of the app back at rest is compared with its baseline: no
asyncio task, socket or descriptor left behind, the router's per-request tables empty again,
resident memory within a small bound, and the counters balanced."""

from __future__ import annotations

import json
import os

import pytest

from loadtest.soak import run_soak

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

LONG = os.environ.get("LLMC_LONG") == "1"
DURATION_S = 600 if LONG else 75
RSS_BOUND_MB = 60 if LONG else 30  # per actor, baseline at rest to end at rest


@pytest.fixture(scope="module")
def soak(rel, tmp_path_factory):
    out = run_soak(
        rel.name, rel.base_url, rel.keys, duration_s=DURATION_S, warmup_s=10, workers=4, sample_every_s=5
    )
    (tmp_path_factory.mktemp("soak") / "soak.json").write_text(json.dumps(out, indent=2))
    print("\nsoak:", json.dumps({k: v for k, v in out.items() if k not in ("actors", "router_counters")}))
    return out


def test_every_request_ended_cleanly(soak) -> None:
    """Nobody hung or was cut off; an occasional upstream timeout on a loaded box is an OpenAI error."""
    ends = soak["endings"]
    assert set(ends) <= {"completed", "failed_over", "cancelled", "error_status", "error_event"}, ends
    assert ends.get("error_status", 0) + ends.get("error_event", 0) <= 0.01 * soak["requests"], ends
    assert soak["bad_error_shape"] == 0
    assert soak["requests"] > 100


def test_nothing_left_behind(soak) -> None:
    assert soak["leaked_tasks"] == 0, {k: a.get("new_tasks") for k, a in soak["actors"].items()}
    for name, a in soak["actors"].items():
        if "tasks_end" not in a:
            continue
        assert a["sockets_end"] <= a["sockets_start"] + 4, (name, a)
        assert a["fds_end"] <= a["fds_start"] + 8, (name, a)
        tables = a.get("routing_tables_end")
        if tables is not None:  # the router's per-request entries are all forgotten at rest
            assert all(tables[k] == 0 for k in ("pending", "routed", "hashes", "decisions")), (name, tables)


def test_memory_stays_within_bounds(soak) -> None:
    grown = {k: v for k, v in soak["rss_growth_mb"].items() if v > RSS_BOUND_MB}
    assert grown == {}, grown


def test_counters_balance(soak) -> None:
    for c in soak["router_counters"].values():
        assert c["balanced"] and c["in_flight"] == 0 and c["double_release"] == 0, c
