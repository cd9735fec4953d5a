"""Accounting on a clean run of the mixed load (no faults; clients that leave mid-stream included):
the gateways' counters (summed over the gateway replicas, each read from its actor) say admitted =
completed + errored + cancelled, and agree with what the clients saw; the tokens each provider
counted equal the usage our clients were given, request by request for OpenAI (our id travels as
x-client-request-id), in total for Anthropic; and the provider adapters' own totals and cost (the
adapters run inside each gateway replica: summed over them) agree with the providers' counts."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from loadtest.benchmarks.faults import provider_accounting
from loadtest.common.actor_probe import gateway_counters, provider_totals, wait_idle
from loadtest.common.reliability import ANTHROPIC_BACKEND, OPENAI_BACKEND, Load

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

FIELDS = ("admitted", "completed", "errored", "cancelled")


def _adapter_totals(rel) -> dict[str, dict[str, float]]:
    return provider_totals(rel.name, (OPENAI_BACKEND, ANTHROPIC_BACKEND))


@pytest.fixture(scope="module")
def clean_run(rel):
    wait_idle(rel.name)
    rel.oai.reset()
    rel.ant.reset()
    before = gateway_counters(rel.name)
    totals0 = _adapter_totals(rel)
    load = Load(rel.base_url, rel.keys, workers=4, think_s=0.05, max_s=15, max_requests=400, seed=7)
    with load:
        time.sleep(15)
    records = load.snapshot()
    after = wait_idle(rel.name)  # the adapters count a request's usage before it is released
    return {
        "records": records,
        "before": before,
        "after": after,
        "totals0": totals0,
        "totals1": _adapter_totals(rel),
        "accounting": provider_accounting(records, rel.oai, rel.ant),
    }


def _errors(ends: Counter[str]) -> int:
    return ends["error_status"] + ends["error_event"]


def test_clean_run_ends_cleanly(clean_run) -> None:
    """No fault injected: served or cancelled by the client (an upstream timeout on a loaded box at most
    now and then, as an OpenAI error)."""
    ends = Counter(r.outcome for r in clean_run["records"])
    assert set(ends) <= {"completed", "failed_over", "cancelled", "error_status", "error_event"}, ends
    assert _errors(ends) <= 0.02 * len(clean_run["records"]), ends
    # Each request ends as its client meant: the "cancel" shape's clients leave after 3 chunks,
    # every other one reads to the end (or gets a clean error, counted above).
    for r in clean_run["records"]:
        if r.outcome in ("error_status", "error_event"):
            continue
        want = {"cancelled"} if r.shape == "cancel" else {"completed", "failed_over"}
        assert r.outcome in want, r
    assert ends["completed"] > 0 and ends["cancelled"] > 0, ends


def test_gateway_counters_balance_and_match_the_clients(clean_run) -> None:
    before, after = clean_run["before"], clean_run["after"]
    assert before and set(before) == set(after), "a gateway replica restarted during the run"
    for c in after.values():
        assert c["balanced"] and c["in_flight"] == 0 and c["double_release"] == 0, c
    delta = {f: sum(after[r][f] - before[r][f] for r in after) for f in FIELDS}
    assert delta["admitted"] == delta["completed"] + delta["errored"] + delta["cancelled"], delta
    ends = Counter(r.outcome for r in clean_run["records"])
    assert delta["admitted"] == len(clean_run["records"]), (delta, ends)
    assert delta["completed"] == ends["completed"] + ends["failed_over"], (delta, ends)
    assert delta["cancelled"] == ends["cancelled"], (delta, ends)
    assert delta["errored"] == _errors(ends), (delta, ends)


def test_provider_tokens_equal_our_usage(clean_run) -> None:
    acc = clean_run["accounting"]
    ends = Counter(r.outcome for r in clean_run["records"])
    for label in ("openai", "anthropic"):
        a = acc[label]
        assert a["provider_requests_ok"] > 0 and a["served_without_usage"] == 0, a
        if not _errors(ends):  # else a provider may have finished what our client saw time out
            assert a["provider_requests_ok"] == a["our_requests_served"] and a["diff"] == 0, a
    oai = acc["openai"]
    assert oai["per_request_mismatches"] == [] and oai["finished_unknown"] == [], oai
    assert oai["diff_delivered"] == 0, oai


def test_adapter_totals_and_cost_match_the_providers(rel, clean_run) -> None:
    prices = {"prompt": 0.15 / 1e6, "completion": 0.6 / 1e6}
    for backend, server in ((OPENAI_BACKEND, rel.oai), (ANTHROPIC_BACKEND, rel.ant)):
        ok = [x for x in server.stats().records if x.outcome == "ok"]
        t0 = clean_run["totals0"].get(backend, {"prompt": 0, "completion": 0, "cost": 0.0})
        t1 = clean_run["totals1"][backend]
        assert set(clean_run["totals1"]) == {OPENAI_BACKEND, ANTHROPIC_BACKEND}, clean_run["totals1"]
        prompt = sum(x.prompt_tokens for x in ok)
        completion = sum(x.completion_tokens for x in ok)
        got_prompt, got_completion = t1["prompt"] - t0["prompt"], t1["completion"] - t0["completion"]
        # Every request that reached the provider is in our books once: settled with its usage, or
        # counted as ended without it (a client gone, a lost hedge, a timeout; issue 15 item 5).
        reached = [x for x in server.stats().records if not x.outcome.startswith("status:")]
        ours = (t1["requests"] - t0.get("requests", 0)) + (t1["unsettled"] - t0.get("unsettled", 0))
        assert ours == len(reached), (backend, ours, Counter(x.outcome for x in reached))
        if _errors(Counter(r.outcome for r in clean_run["records"])):
            # A provider may finish an answer whose client timed out first: we counted that one as
            # ended without usage (above), so the settled tokens are those of the rest.
            assert got_prompt <= prompt and got_completion <= completion, backend
            continue
        assert (got_prompt, got_completion) == (prompt, completion), backend
        expected = prompt * prices["prompt"] + completion * prices["completion"]
        assert t1["cost"] - t0["cost"] == pytest.approx(expected, rel=1e-6, abs=1e-12), backend
