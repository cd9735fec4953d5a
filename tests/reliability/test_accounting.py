"""Accounting on a clean run of the mixed load (no faults; clients that leave mid-stream included):
the router's counters say admitted = completed + errored + cancelled, and agree with what the
clients saw; the tokens each provider counted equal the usage our clients were given, request by
request for OpenAI (our id travels as x-client-request-id), in total for Anthropic; and the provider
adapters' own totals and cost agree with the providers' counts."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from loadtest.faults import provider_accounting
from tests.reliability.harness import ANTHROPIC_BACKEND, OPENAI_BACKEND, Load, router_counters, wait_idle

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

FIELDS = ("admitted", "completed", "errored", "cancelled")


def _adapter_totals(rel) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for s in rel.cluster.replica_stats().values():
        if s.backend in (OPENAI_BACKEND, ANTHROPIC_BACKEND):
            t = out.setdefault(s.backend, {"prompt": 0, "completion": 0, "cost": 0.0})
            t["prompt"] += s.extra.get("prompt_tokens_total", 0)
            t["completion"] += s.extra.get("completion_tokens_total", 0)
            t["cost"] += s.extra.get("cost_usd_total", 0.0)
    return out


@pytest.fixture(scope="module")
def clean_run(rel):
    wait_idle(rel.name)
    rel.oai.reset()
    rel.ant.reset()
    before = router_counters(rel.name)
    totals0 = _adapter_totals(rel)
    load = Load(rel.base_url, rel.keys, workers=4, think_s=0.05, max_s=15, max_requests=400, seed=7)
    with load:
        time.sleep(15)
    records = load.snapshot()
    after = wait_idle(rel.name)
    time.sleep(0.6)  # the adapters' totals reach the stats hub every 0.2 s
    return {
        "records": records,
        "before": before,
        "after": after,
        "totals0": totals0,
        "totals1": _adapter_totals(rel),
        "accounting": provider_accounting(records, rel.oai, rel.ant),
    }


def test_clean_run_ends_cleanly(clean_run) -> None:
    ends = Counter(r.outcome for r in clean_run["records"])
    assert set(ends) <= {"completed", "failed_over", "cancelled"}, ends
    assert ends["completed"] > 50 and ends["cancelled"] > 0, ends


def test_router_counters_balance_and_match_the_clients(clean_run) -> None:
    before, after = clean_run["before"], clean_run["after"]
    assert set(before) == set(after), "a router replica restarted during the run"
    for c in after.values():
        assert c["balanced"] and c["in_flight"] == 0 and c["double_release"] == 0, c
    delta = {f: sum(after[r][f] - before[r][f] for r in after) for f in FIELDS}
    assert delta["admitted"] == delta["completed"] + delta["errored"] + delta["cancelled"], delta
    ends = Counter(r.outcome for r in clean_run["records"])
    assert delta["admitted"] == len(clean_run["records"]), (delta, ends)
    assert delta["completed"] == ends["completed"] + ends["failed_over"], (delta, ends)
    assert delta["cancelled"] == ends["cancelled"], (delta, ends)
    assert delta["errored"] == 0, delta


def test_provider_tokens_equal_our_usage(clean_run) -> None:
    acc = clean_run["accounting"]
    for label in ("openai", "anthropic"):
        a = acc[label]
        assert a["provider_requests_ok"] > 0 and a["provider_requests_ok"] == a["our_requests_served"], a
        assert a["diff"] == 0, a
        assert a["served_without_usage"] == 0, a
    assert acc["openai"]["per_request_mismatches"] == [], acc
    assert acc["openai"]["finished_not_delivered"] == [] and acc["openai"]["finished_unknown"] == [], acc


def test_adapter_totals_and_cost_match_the_providers(rel, clean_run) -> None:
    prices = {"prompt": 0.15 / 1e6, "completion": 0.6 / 1e6}
    for backend, server in ((OPENAI_BACKEND, rel.oai), (ANTHROPIC_BACKEND, rel.ant)):
        ok = [x for x in server.stats().records if x.outcome == "ok"]
        t0 = clean_run["totals0"].get(backend, {"prompt": 0, "completion": 0, "cost": 0.0})
        t1 = clean_run["totals1"][backend]
        prompt = sum(x.prompt_tokens for x in ok)
        completion = sum(x.completion_tokens for x in ok)
        assert t1["prompt"] - t0["prompt"] == prompt, backend
        assert t1["completion"] - t0["completion"] == completion, backend
        expected = prompt * prices["prompt"] + completion * prices["completion"]
        assert t1["cost"] - t0["cost"] == pytest.approx(expected, rel=1e-6, abs=1e-12), backend
