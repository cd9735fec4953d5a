"""The noisy-neighbour benchmark's pure parts: each tenant's load, the budget's allowance, why a
refusal came, the per-tenant figures and the admission checks summed over gateway replicas."""

from __future__ import annotations

from loadtest.benchmarks.bench_noisy_neighbour import (
    admission_checks,
    allowance,
    b_tab_p99_ratio,
    phase_figures,
    refusal_reason,
    tenant_load,
    variant_config,
)
from loadtest.common.request_spec import RequestSpec
from loadtest.common.sim_live import Result, _request


def test_each_tenant_gets_its_own_sessions_and_header() -> None:
    specs = tenant_load({"a": {"agent": 4.0}, "b": {"tab": 2.0, "agent": 0.0}}, 10.0, 1)
    by = {t: [s for s in specs if s.tenant == t] for t in ("a", "b")}
    assert by["a"] and by["b"] and len(by["a"]) + len(by["b"]) == len(specs)
    assert {s.surface for s in by["a"]} == {"agent"} and {s.surface for s in by["b"]} == {"tab"}
    assert all(s.session_id.startswith(f"{s.tenant}-") for s in specs)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert max(s.arrival_s for s in specs) < 10.0
    _, headers = _request(by["a"][0], "m", True)
    assert headers["x-tenant"] == "a" and headers["x-surface"] == "agent"
    assert by["b"][0].headers()["x-tenant"] == "b"
    assert "x-tenant" not in RequestSpec(session_id="s", max_tokens=1).headers()


def test_the_budget_allows_a_full_bucket_and_its_refill() -> None:
    assert allowance(60, 30.0) == 90  # a minute's 60 at once, then one a second
    assert allowance(60, 30.0, 5.0) == 35  # 5 s of it at once
    assert allowance(6, 30.0, 5.0) == 4  # at least one request at once, then one each 10 s
    assert allowance(None, 30.0) is None


def test_variants_differ_only_in_a_budget() -> None:
    off, on, short = (
        variant_config("off", None),
        variant_config("on", 120),
        variant_config("on_short_burst", 120, 5),
    )
    assert [(t.name, t.rpm, t.burst_s) for t in off.tenants] == [("a", None, 60), ("b", None, 60)]
    assert [(t.name, t.rpm, t.burst_s) for t in on.tenants] == [("a", 120, 60), ("b", None, 60)]
    assert [(t.name, t.rpm, t.burst_s) for t in short.tenants] == [("a", 120, 5), ("b", None, 60)]
    assert off.server.gateway_replicas == on.server.gateway_replicas == short.server.gateway_replicas == 2
    assert len({off.name, on.name, short.name}) == 3


def _res(
    i: int, surface: str, status: int, latency: float, ttft: float | None = None, error: str = ""
) -> Result:
    r = Result(i, f"s{i}", surface, status=status, ttft_s=ttft, latency_s=latency, error=error or None)
    r.output_tokens = 10 if status == 200 else 0
    r.retry_after = "1" if status == 429 else None
    return r


def test_a_phase_splits_refusals_by_reason_and_times_the_at_once_ones_apart() -> None:
    cfg = variant_config("on", 60)
    results = [
        _res(0, "tab", 200, 0.05, 0.02),
        _res(1, "agent", 200, 1.0, 0.5),
        _res(2, "agent", 429, 0.002, error="tenant 'a' is over its budget: ..."),
        _res(3, "agent", 429, 0.9, error="... went to a tenant with a smaller share of it; retry"),
        _res(4, "agent", 429, 0.004, error="surface 'agent' is at its limit of 3 requests with 2 waiting"),
    ]
    specs = [
        RequestSpec(session_id="b", max_tokens=1, surface="tab", tenant="b"),
        RequestSpec(session_id="b2", max_tokens=1, surface="agent", tenant="b"),
        *[RequestSpec(session_id=f"a{i}", max_tokens=1, surface="agent", tenant="a") for i in range(3)],
    ]
    assert [refusal_reason(r) for r in results[2:]] == ["budget", "pushed_out", "admission"]
    rep = phase_figures(results, specs, cfg, 10.0)
    assert rep["a_refusals"] == {"budget": 1, "pushed_out": 1, "admission": 1}
    assert rep["rejects"] == 3 and rep["reject_p99_ms"] == 900.0 and rep["reject_at_once_p99_ms"] == 4.0
    assert rep["tenants"]["b"]["tab"]["admitted"] == 1 and rep["tenants"]["a"]["agent"]["admitted"] == 0
    assert rep["tenants"]["b"]["agent"]["goodput_tok_s"] == 1.0  # 10 tokens in 10 s within 3 s
    assert rep["a_refusals_without_retry_after"] == 0 and rep["hung"] == 0


def test_admission_is_summed_over_every_gateway_replica() -> None:
    def st(admitted: int, completed: int, in_flight: int = 0) -> dict:
        return {
            "admission": {
                "admitted": admitted,
                "completed": completed,
                "errored": 0,
                "cancelled": 0,
                "in_flight": in_flight,
                "waiting": 0,
                "balanced": True,
            }
        }

    before = {"g1": st(10, 10), "g2": st(5, 5)}
    ok = admission_checks(before, {"g1": st(14, 14), "g2": st(8, 8)})
    assert ok["admission_delta"]["admitted"] == 7 and all(ok["checks"].values()) and ok["gateways_seen"] == 2
    left = admission_checks(before, {"g1": st(14, 13, 1), "g2": st(8, 8)})
    assert not left["checks"]["admitted_equals_ended"]
    assert not left["checks"]["nothing_in_flight_or_waiting_after"]


def test_the_ratio_is_bs_tab_p99_with_the_flood_over_alone() -> None:
    def ph(p99: float | None) -> dict:
        return {"tenants": {"b": {"tab": {"ttft_p99_wall_ms": p99}}}}

    assert b_tab_p99_ratio({"b_alone": ph(40.0), "a_flood": ph(46.0)}) == 1.15
    assert b_tab_p99_ratio({"b_alone": ph(None), "a_flood": ph(46.0)}) is None
    assert b_tab_p99_ratio({"b_alone": ph(40.0)}) is None


def test_slices_tell_the_floods_start_from_the_rest() -> None:
    from loadtest.benchmarks.bench_noisy_neighbour import slices

    def at(i: int, sent: float, surface: str, status: int, ttft: float | None = None) -> Result:
        r = Result(i, f"s{i}", surface, sent_s=sent, status=status, ttft_s=ttft)
        return r

    results = [
        at(0, 1.0, "tab", 200, 0.080),
        at(1, 2.0, "agent", 200),
        at(2, 3.0, "agent", 200),
        at(3, 12.0, "tab", 200, 0.020),
        at(4, 13.0, "agent", 429),
        at(5, 25.0, "agent", 200),
        at(6, 31.0, "tab", 200, 0.030),  # sent at the very end: the last slice
    ]
    tenants = ["b", "a", "a", "b", "a", "a", "b"]
    got = slices(results, tenants, 30.0)
    assert got == {"b_tab_p99_ms": [80.0, 20.0, 30.0], "a_admitted": [2, 0, 1]}


def test_the_slowest_tab_requests_say_where_their_time_went() -> None:
    from loadtest.benchmarks.bench_noisy_neighbour import slowest_tab

    def at(sent: float, surface: str, tenant: str, ttft: float | None, timing: str | None = None) -> tuple:
        r = Result(0, "s", surface, sent_s=sent, status=200, ttft_s=ttft, replica="r1")
        r.timing = timing
        return r, RequestSpec(session_id="s", max_tokens=1, surface=surface, tenant=tenant)

    rows = [
        at(0.3, "agent", "a", 0.3),  # more than 1 s before the slowest
        at(0.9, "agent", "a", 0.3),
        at(1.2, "agent", "b", 0.3),
        at(1.4, "tab", "b", 0.070, "prep;dur=0.4, queue;dur=0.0, upstream;dur=60.1, ttft;dur=61.0"),
        at(5.0, "tab", "b", 0.020),
        at(6.0, "tab", "a", 0.900),  # not b's
        at(7.0, "tab", "b", 0.015),
    ]
    got = slowest_tab([r for r, _ in rows], [s for _, s in rows], n=2)
    assert [g["ttft_ms"] for g in got] == [70.0, 20.0]
    assert got[0]["server_timing_ms"] == {"prep": 0.4, "queue": 0.0, "upstream": 60.1, "ttft": 61.0}
    assert got[0]["agent_sent_in_1s_before"] == {"a": 1, "b": 1} and got[0]["sent_s"] == 1.4
    assert got[1]["server_timing_ms"] == {} and got[1]["agent_sent_in_1s_before"] == {"a": 0, "b": 0}


def test_a_probe_of_some_variants_needs_agents_capacity() -> None:
    import pytest

    from loadtest.benchmarks.bench_noisy_neighbour import parse_args

    assert parse_args([]).variants == ["off", "on", "on_short_burst"]
    assert parse_args(["--variants", "on_short_burst", "--capacity", "11.5"]).variants == ["on_short_burst"]
    for bad in (["--variants", "on"], ["--variants", "off,sometimes"], ["--variants", ","]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_prefill_avoidance_is_counted_over_a_gateways_backends() -> None:
    from loadtest.benchmarks.bench_noisy_neighbour import avoided_prefill

    status = {"routing": {"sim-shared": {"avoided_prefill": 5}, "other": {"avoided_prefill": 2}}}
    assert avoided_prefill(status) == 7
    assert avoided_prefill({"routing": {"old": {}}}) == 0 and avoided_prefill({}) == 0
