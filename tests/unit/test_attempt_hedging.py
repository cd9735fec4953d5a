"""The gateway's hedge check for one request (``AttemptRunner._hedging``): the hedge budget is asked
once; a request the budget refused still races the next candidate, outside the budget, as soon as
its backend is demoted in a brownout; a hedge the budget did not pay for gives nothing back."""

from __future__ import annotations

import time

import pytest

from cluster.config import load_config
from cluster.policy.failover import BreakerBoard, FailoverPlan, PlannedAttempt
from deployments.gateway.attempts import AttemptRunner, HedgeState

BACKEND = "sim-llama-8b"


def _runner() -> AttemptRunner:
    cfg = load_config("configs/cpu-dev.yaml")
    return AttemptRunner(cfg, {}, {}, lambda: None, "", BreakerBoard())  # type: ignore[arg-type,return-value]


def test_a_refused_hedge_goes_out_once_its_backend_is_demoted_and_costs_no_budget() -> None:
    run = _runner()
    _, may_hedge, unsent = run._hedging("chat", True, run.slots([BACKEND, "sim-fallback"]), None)
    assert run.hedge.budget.tokens == 0  # the budget starts empty
    assert may_hedge(0.5, 0) is False
    assert may_hedge(0.6, 0) is False
    assert run.hedge.stats.hedges_refused == 1  # asked once: the rechecks look for a demotion only
    now = time.monotonic()  # the gateway's clock, which the check reads
    for i in range(12):  # a baseline of fast first tokens, then two hedges that beat the backend
        run.brownout.observe("chat", BACKEND, 0.1, now - 1.0 + i / 100)
    run.brownout.hedge_won("chat", BACKEND, now)
    run.brownout.hedge_won("chat", BACKEND, now)
    assert run.brownout.demoted(BACKEND, now)
    assert may_hedge(0.7, 0) is True  # demoted: it races the next candidate now
    assert may_hedge(0.8, 1) is False  # one such hedge per request
    unsent()  # that hedge found no candidate: the budget, which never paid, gets nothing
    assert run.hedge.budget.tokens == 0


def test_a_hedge_the_budget_paid_for_gives_its_token_back_when_unsent() -> None:
    run = _runner()
    for _ in range(40):  # 5 % a request: two tokens
        run.hedge.on_request()
    _, may_hedge, unsent = run._hedging("chat", True, run.slots([BACKEND, "sim-fallback"]), None)
    before = run.hedge.budget.tokens
    assert may_hedge(0.5, 0) is True
    assert run.hedge.budget.tokens == before - 1
    unsent()
    assert run.hedge.budget.tokens == before


def test_the_hedge_delay_is_at_most_the_brownout_slow_threshold() -> None:
    """In a brownout the TTFT quantile climbs to the slow first tokens themselves (here 1 s); the
    delay stays at the brownout's threshold (3x a 0.1 s baseline), where a race still helps."""
    run = _runner()
    now = time.monotonic()
    for i in range(40):
        run.hedge.observe_ttft("chat", BACKEND, 1.0, now - 5 + i / 100)
    delay, _, _ = run._hedging("chat", True, run.slots([BACKEND, "sim-fallback"]), None)
    first = run.slots([BACKEND])[0]
    planned = PlannedAttempt(first, 0, False)
    assert delay(planned) == pytest.approx(1.0, abs=0.05)  # no baseline yet: the quantile
    for i in range(12):
        run.brownout.observe("chat", BACKEND, 0.1, now - 1.0 + i / 100)
    assert delay(planned) == pytest.approx(0.3)


def test_a_surface_without_hedging_races_only_a_demoted_backend_and_never_spends_the_budget() -> None:
    """Tab in this config does not hedge: no budget hedge, but a request still waiting on its
    backend once that backend is demoted in a brownout races the next candidate, as a probe does
    (the rehearsal's Chat, without hedging, waited the brownout out: p99 3-4x steady)."""
    run = _runner()
    for _ in range(100):
        run.hedge.on_request()
    tokens = run.hedge.budget.tokens
    delay, may_hedge, unsent = run._hedging("tab", False, run.slots([BACKEND, "sim-fallback"]), None)
    first = PlannedAttempt(run.slots([BACKEND])[0], 0, False)
    assert delay(first) is None  # no baseline yet: nothing to race from
    now = time.monotonic()
    for i in range(12):
        run.brownout.observe("tab", BACKEND, 0.1, now - 1.0 + i / 100)
    assert delay(first) == pytest.approx(0.3)  # from the brownout's slow threshold
    assert may_hedge(0.5, 0) is False  # slow, but not demoted: no hedge on this surface
    run.brownout.hedge_won("tab", BACKEND, now)
    run.brownout.hedge_won("tab", BACKEND, now)
    assert may_hedge(0.6, 0) is True
    unsent()
    assert run.hedge.budget.tokens == tokens and run.hedge.stats.hedges_refused == 0


def test_a_demoted_backend_alone_on_its_route_is_not_raced_to_its_own_other_replica() -> None:
    """The brownout race escapes a backend to another one; with the next slot another replica of
    the same backend (a self-hosted backend alone on its route) it would only move a slow request
    off the replica holding its context: bench_affinity's fits hit rate fell 0.80 -> 0.71 so."""
    run = _runner()
    slots = run.slots([BACKEND])
    assert len(slots) == 2 and slots[1] != slots[0]  # two replicas: two slots of one backend
    _, may_hedge, _ = run._hedging("tab", False, slots, None)
    now = time.monotonic()
    for i in range(12):
        run.brownout.observe("tab", BACKEND, 0.1, now - 1.0 + i / 100)
    run.brownout.hedge_won("tab", BACKEND, now)
    run.brownout.hedge_won("tab", BACKEND, now)
    assert run.brownout.demoted(BACKEND, now)
    assert may_hedge(0.7, 0) is False  # demoted, but nowhere else to go
    both = run.slots([BACKEND, "sim-fallback"])
    assert both[1] == slots[1]  # with another backend further on, its second replica comes next ...
    state = HedgeState()
    _, may_hedge, _ = run._hedging("tab", False, both, None, state)
    assert may_hedge(0.7, 0) is True and state.escape  # ... and the race passes it over:
    plan = FailoverPlan(both)
    assert plan.next(now, {}) == PlannedAttempt(both[0], 0)
    same = lambda x: x.split("#")[0] == BACKEND  # noqa: E731
    assert plan.next(now, {}, hedge=True, skip=same) == PlannedAttempt("sim-fallback", 1)
