"""Tenants: budgets per minute (429 + Retry-After at once), settled with usage, and fair queuing by
weight inside a surface, so a heavy tenant cannot take every freed slot from a light one."""

from __future__ import annotations

import pickle

import pytest

from cluster.config import ConfigError, SurfaceConfig, TenantConfig, parse_config
from cluster.policy.admission import AdmissionController, Queued, Ticket
from cluster.policy.rate_budget import Refusal
from cluster.policy.tenants import (
    KnownOut,
    OverBudget,
    TenantBudgets,
    TenantReservation,
    over_budget,
    spent_tokens,
)
from cluster.wire.errors import RateLimited
from cluster.wire.protocol import Usage
from deployments.budgets.tenant_budget import tenant_budgets


def test_a_tenant_over_its_request_budget_gets_a_429_with_retry_after() -> None:
    b = TenantBudgets([TenantConfig(name="a", rpm=60), TenantConfig(name="b")], 0.0)
    got = [b.reserve("a", 10, 10, 0.0) for _ in range(61)]
    assert all(isinstance(r, TenantReservation) for r in got[:60])
    assert isinstance(got[60], Refusal) and got[60].reason == "rpm"
    refused = over_budget("a", got[60])  # the 429 the gateway sends
    assert isinstance(refused, RateLimited) and refused.status_code == 429
    assert refused.retry_after_s == pytest.approx(1.0)  # one request a second comes back
    assert "tenant 'a'" in refused.message
    assert b.reserve("b", 10, 10, 0.0) is None and b.reserve(None, 10, 10, 0.0) is None  # no budget


def test_token_budget_is_reserved_then_settled_with_usage() -> None:
    b = TenantBudgets([TenantConfig(name="a", tpm=1000)], 0.0)
    r1 = b.reserve("a", 300, 500, 0.0)  # 800 reserved
    assert isinstance(r1, TenantReservation)
    assert isinstance(b.reserve("a", 100, 200, 0.0), Refusal)  # 300 more: over
    b.settle(r1, 350, 0.0)  # used 350: 450 back, 650 left
    assert isinstance(b.reserve("a", 100, 200, 0.0), TenantReservation)  # 350 left
    assert isinstance(b.reserve("a", 100, 200, 0.0), TenantReservation)  # 50 left
    assert isinstance(b.reserve("a", 100, 200, 0.0), Refusal)
    b2 = TenantBudgets([TenantConfig(name="a", rpm=1)], 0.0)
    r = b2.reserve("a", 1, 1, 0.0)
    assert isinstance(r, TenantReservation)
    b2.cancel(r, 0.0)  # refused by admission: the request comes back
    assert isinstance(b2.reserve("a", 1, 1, 0.0), TenantReservation)


def test_keys_name_known_tenants() -> None:
    base = {
        "models": [{"name": "m", "tokenizer": "estimate:4", "context_window": 100}],
        "backends": [{"name": "b", "kind": "sim", "model": "m"}],
        "surfaces": [{"name": "chat"}],
        "tenants": [{"name": "acme", "rpm": 10, "weight": 2}],
    }
    key = {"sha256": "0" * 64, "surface": "chat", "tenant": "acme"}
    cfg = parse_config({**base, "server": {"api_keys": [key]}})
    assert cfg.tenant("acme") is not None and cfg.tenant("acme").weight == 2  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"api_keys\.0\.tenant|unknown tenant 'nobody'"):
        parse_config({**base, "server": {"api_keys": [{**key, "tenant": "nobody"}]}})


def test_freed_slots_go_to_queued_tenants_by_weight() -> None:
    s = SurfaceConfig(name="agent", priority=2, max_concurrency=1, max_queue=100, queue_deadline_ms=60_000)
    c = AdmissionController([s], tenant_weights={"heavy": 1.0, "light": 1.0, "gold": 2.0})
    running = c.try_admit("agent", 0.0, tenant="heavy")
    assert isinstance(running, Ticket)
    heavy = [c.try_admit("agent", 0.1, tenant="heavy") for _ in range(10)]  # a runaway loop
    light = [c.try_admit("agent", 0.2, tenant="light") for _ in range(2)]  # arrives after all of it
    assert all(isinstance(q, Queued) for q in heavy + light)
    order: list[str] = []
    ticket = running
    for i in range(6):
        (ticket,) = c.release(ticket, "completed", 1.0 + i)
        order.append("light" if ticket.id in {q.id for q in light} else "heavy")
    # Alternating from the first freed slot, instead of after the heavy tenant's ten.
    assert order[:4] == ["light", "heavy", "light", "heavy"]
    assert c.counters().balanced()


def test_a_heavier_weight_gets_more_of_the_freed_slots() -> None:
    s = SurfaceConfig(name="agent", priority=2, max_concurrency=1, max_queue=100, queue_deadline_ms=60_000)
    c = AdmissionController([s], tenant_weights={"std": 1.0, "gold": 2.0})
    ticket = c.try_admit("agent", 0.0)
    assert isinstance(ticket, Ticket)
    ids = {"std": set(), "gold": set()}
    for _ in range(12):
        for t in ("std", "gold"):
            q = c.try_admit("agent", 0.1, tenant=t)
            assert isinstance(q, Queued)
            ids[t].add(q.id)
    got = []
    for i in range(9):
        (ticket,) = c.release(ticket, "completed", 1.0 + i)
        got.append("gold" if ticket.id in ids["gold"] else "std")
    assert got.count("gold") == 6 and got.count("std") == 3  # 2 : 1


def test_a_spent_request_budget_says_how_long_every_request_is_refused() -> None:
    b = TenantBudgets([TenantConfig(name="a", rpm=60, tpm=100_000), TenantConfig(name="t", tpm=100)], 0.0)
    for _ in range(60):
        assert isinstance(b.reserve("a", 1, 1, 0.0), TenantReservation)
    refusal = b.reserve("a", 1, 1, 0.5)
    assert isinstance(refusal, Refusal)
    spent = over_budget("a", refusal)
    assert isinstance(spent, OverBudget) and spent.status_code == 429
    assert spent.all_refused_s == pytest.approx(0.5)  # one request a second: the next at t = 1
    back = pickle.loads(pickle.dumps(spent))  # it crosses the budget deployment's Ray call
    assert isinstance(back, OverBudget) and back.all_refused_s == spent.all_refused_s
    assert back.retry_after_s == spent.retry_after_s and back.message == spent.message
    tokens = b.reserve("t", 90, 20, 0.0)  # over the token budget only: a smaller one may pass
    assert isinstance(tokens, Refusal) and tokens.all_refused_s == 0.0


def test_a_replica_refuses_a_spent_tenant_before_asking_until_its_bucket_refills() -> None:
    out = KnownOut()
    out.note("a", OverBudget("over", retry_after_s=2.0, all_refused_s=2.0), 10.0)
    out.note("t", OverBudget("over", retry_after_s=3.0, all_refused_s=0.0), 10.0)  # tokens only
    r = out.refusal("a", 11.0)
    assert isinstance(r, RateLimited) and r.retry_after_s == pytest.approx(1.0) and "tenant 'a'" in r.message
    assert out.refusal("a", 12.0) is None and out.refusal("a", 11.0) is None  # refilled: forgotten
    assert (
        out.refusal("t", 10.5) is None and out.refusal(None, 10.5) is None and out.refusal("b", 10.5) is None
    )


async def test_the_local_budgets_remember_a_spent_tenant() -> None:
    local = tenant_budgets([TenantConfig(name="a", rpm=1)], None)
    assert local.refusal("a") is None
    assert isinstance(await local.reserve("a", 1, 1), TenantReservation)
    assert isinstance(await local.reserve("a", 1, 1), OverBudget)  # the minute's one is spent
    r = local.refusal("a")  # so the next is refused without asking
    assert r is not None and 59.0 < (r.retry_after_s or 0) <= 60.0


def test_a_short_burst_spreads_a_tenants_requests_and_keeps_a_minutes_tokens() -> None:
    b = TenantBudgets([TenantConfig(name="a", rpm=120, tpm=6_000, burst_s=5)], 0.0)
    got = [b.reserve("a", 10, 10, 0.0) for _ in range(11)]
    assert [isinstance(r, TenantReservation) for r in got] == [True] * 10 + [False]  # 5 s of 2 a second
    assert isinstance(got[10], Refusal) and got[10].all_refused_s == pytest.approx(0.5)
    assert isinstance(b.reserve("a", 10, 10, 0.5), TenantReservation)  # refilled at 2 a second
    # the token bucket still holds the minute's 6,000: one request of 5,000 fits
    assert isinstance(b.reserve("a", 4_000, 1_000, 1.0), TenantReservation)
    with pytest.raises(ValueError):
        TenantConfig(name="x", rpm=1, burst_s=0)


def test_a_request_that_ends_without_usage_settles_with_what_it_spent() -> None:
    """Issue 47 item 4: a client that left mid-stream settled with 0, so prompt + max_tokens went
    back although the engine prefilled and generated. Now: the prompt and the tokens relayed."""
    assert spent_tokens(Usage(100, 20), 100, 5, sent=True) == 120  # usage reported: it counts
    assert spent_tokens(None, 100, 5, sent=True) == 105  # left after 5 tokens
    assert spent_tokens(Usage(), 100, 7, sent=True) == 107  # an error frame's empty usage
    assert spent_tokens(None, 100, 0, sent=True) == 100  # left before the first token: prefilled
    assert spent_tokens(None, 100, 0, sent=False) == 0  # never sent (refused before a token)
    b = TenantBudgets([TenantConfig(name="a", tpm=1000)], 0.0)
    served = 0
    while isinstance(r := b.reserve("a", 100, 500, 0.0), TenantReservation):
        b.settle(r, spent_tokens(None, 100, 3, sent=True), 0.0)  # the client leaves each time
        served += 1
    # 103 each: the 600 a request reserves no longer fits after four of them (1000 - 4 * 103)
    assert served == 4 and isinstance(r, Refusal)
