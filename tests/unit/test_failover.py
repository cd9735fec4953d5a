import asyncio
import pickle

import pytest
from pydantic import ValidationError

from cluster.policy.failover import (
    BreakerBoard,
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    FailoverConfig,
    FailoverPlan,
    PlannedAttempt,
    ReplicaEjector,
    RetryBudget,
    RetryBudgetConfig,
    WindowCounts,
    classify,
    counts_against_backend,
)
from cluster.wire.errors import (
    Action,
    BackendUnavailable,
    ContextLengthExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    ProviderAuthError,
    RateLimited,
    StreamInterrupted,
    Unauthorized,
    UpstreamTimeout,
)

# ---------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "action"),
    [
        (BackendUnavailable("x"), Action.RETRY_ELSEWHERE),
        (UpstreamTimeout("x"), Action.RETRY_ELSEWHERE),
        (RateLimited("x", retry_after_s=3), Action.RETRY_ELSEWHERE),
        (Overloaded("x"), Action.RETRY_ELSEWHERE),
        (InvalidRequest("x"), Action.CLIENT),
        (ContextLengthExceeded("x"), Action.CLIENT),
        (Unauthorized("x"), Action.CLIENT),
        (NotFound("x"), Action.CLIENT),
        (ProviderAuthError("x"), Action.FATAL),
        (StreamInterrupted("x"), Action.FATAL),
        (ConnectionError("refused"), Action.RETRY_ELSEWHERE),
        (ConnectionResetError("reset"), Action.RETRY_ELSEWHERE),
        (TimeoutError(), Action.RETRY_ELSEWHERE),
        (asyncio.TimeoutError(), Action.RETRY_ELSEWHERE),  # noqa: UP041 - what asyncio code raises
        (OSError("unreachable"), Action.RETRY_ELSEWHERE),
        (RuntimeError("replica died"), Action.RETRY_ELSEWHERE),
        (asyncio.CancelledError(), Action.FATAL),
        (KeyboardInterrupt(), Action.FATAL),
    ],
)
def test_classify(exc, action):
    assert classify(exc) is action


def test_classify_survives_pickling():
    exc = pickle.loads(pickle.dumps(RateLimited("slow down", retry_after_s=2.0, backend="p")))
    assert classify(exc) is Action.RETRY_ELSEWHERE


@pytest.mark.parametrize(
    ("exc", "counts"),
    [
        (BackendUnavailable("x"), True),
        (UpstreamTimeout("x"), True),
        (Overloaded("x"), True),
        (ProviderAuthError("x"), True),
        (StreamInterrupted("x"), True),
        (ConnectionError(), True),
        (TimeoutError(), True),
        (RuntimeError(), True),
        (RateLimited("x"), False),
        (InvalidRequest("x"), False),
        (ContextLengthExceeded("x"), False),
        (asyncio.CancelledError(), False),
    ],
)
def test_counts_against_backend(exc, counts):
    assert counts_against_backend(exc) is counts


# ---------------------------------------------------------------------------------------------
# Window counts
# ---------------------------------------------------------------------------------------------


def test_window_counts_slide_by_bucket():
    w = WindowCounts(window_s=30.0, buckets=10)  # 3 s slots
    w.add(0.0, a=2, b=1)
    w.add(2.9, b=1)
    w.add(3.0, a=5)
    assert w.totals(3.0) == (7, 2)
    assert w.totals(29.9) == (7, 2)  # slot 9: slots 0..9 are in
    assert w.totals(30.0) == (5, 0)  # slot 10: slot 0 is out
    assert w.totals(33.0) == (0, 0)
    w.add(33.0, a=1)  # reuses slot 1's place
    assert w.totals(33.0) == (1, 0)
    w.clear()
    assert w.totals(33.0) == (0, 0)


# ---------------------------------------------------------------------------------------------
# Circuit breaker
# ---------------------------------------------------------------------------------------------


def _fail(b: CircuitBreaker, n: int, now: float) -> list[bool]:
    return [b.record_failure(now) for _ in range(n)]


def test_defaults_are_documented_values():
    c = BreakerConfig()
    assert (c.consecutive_failures, c.failure_rate, c.min_requests, c.window_s) == (5, 0.5, 20, 30.0)
    assert (c.base_ejection_s, c.ejection_multiplier, c.max_ejection_s) == (5.0, 2.0, 300.0)
    assert c.max_ejection_percent == 50.0
    r = RetryBudgetConfig()
    assert (r.ratio, r.min_per_s, r.window_s) == (0.2, 1.0, 10.0)


def test_config_validation():
    with pytest.raises(ValidationError, match="base_ejection_s"):
        BreakerConfig(base_ejection_s=10, max_ejection_s=5)
    with pytest.raises(ValidationError, match="consecutive_faliures"):
        BreakerConfig(consecutive_faliures=3)
    with pytest.raises(ValidationError):
        BreakerConfig(failure_rate=0)
    with pytest.raises(ValidationError):
        FailoverConfig(max_attempts=0)


def test_state_values_for_metrics():
    assert [int(s) for s in (BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN)] == [0, 1, 2]


def test_consecutive_failures_open():
    b = CircuitBreaker()
    assert _fail(b, 5, now=100.0) == [False, False, False, False, True]
    assert b.state(100.0) is BreakerState.OPEN
    assert (b.opened_at, b.open_until, b.ejections, b.ejections_total) == (100.0, 105.0, 1, 1)
    assert not b.available(104.999)
    assert not b.allow(104.999)
    assert b.state(104.999) is BreakerState.OPEN
    assert b.state(105.0) is BreakerState.HALF_OPEN


def test_success_resets_the_consecutive_count():
    b = CircuitBreaker()
    _fail(b, 4, 0.0)
    b.record_success(0.0)
    assert _fail(b, 4, 0.0) == [False] * 4
    assert b.state(0.0) is BreakerState.CLOSED
    assert b.consecutive_failures == 4


def test_failure_rate_opens_at_exactly_half_of_twenty():
    b = CircuitBreaker(BreakerConfig(consecutive_failures=1000))
    opened = []
    for i in range(20):
        if i % 2 == 0:
            b.record_success(1.0)
        else:
            opened.append(b.record_failure(1.0))
    assert opened == [False] * 9 + [True]
    assert b.state(1.0) is BreakerState.OPEN


def test_failure_rate_needs_min_requests_and_the_rate():
    b = CircuitBreaker(BreakerConfig(consecutive_failures=1000))
    for _ in range(9):
        b.record_success(0.0)
    assert _fail(b, 10, 0.0) == [False] * 10  # 19 requests: too few to trust
    b2 = CircuitBreaker(BreakerConfig(consecutive_failures=1000))
    for _ in range(11):
        b2.record_success(0.0)
    assert _fail(b2, 9, 0.0) == [False] * 9  # 9 of 20 = 45 %
    assert b2.state(0.0) is BreakerState.CLOSED


def test_failure_rate_forgets_outside_the_window():
    def run(later: float) -> bool:
        b = CircuitBreaker(BreakerConfig(consecutive_failures=1000))
        _fail(b, 10, 0.0)
        for _ in range(10):
            b.record_success(later)
        return b.record_failure(later)

    assert run(29.0) is True  # 21 requests, 11 failed
    assert run(30.0) is False  # the first 10 failures slid out: 11 requests


def test_ejection_time_grows_and_caps():
    b = CircuitBreaker(BreakerConfig(ejection_decay_s=1e9))
    now = 0.0
    durations = []
    _fail(b, 5, now)
    for _ in range(9):
        durations.append(b.open_until - b.opened_at)
        now = b.open_until
        assert b.state(now) is BreakerState.HALF_OPEN
        assert b.allow(now)
        assert b.record_failure(now) is True  # a failed probe re-opens at once
    assert durations == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert b.ejections == 10


def test_ejection_time_edges():
    b = CircuitBreaker()
    assert [b.ejection_time(k) for k in (0, 1, 2, 6, 7, 10_000)] == [5, 5, 10, 160, 300, 300]
    flat = CircuitBreaker(BreakerConfig(ejection_multiplier=1.0))
    assert flat.ejection_time(50) == 5
    tight = CircuitBreaker(BreakerConfig(base_ejection_s=5, max_ejection_s=5))
    assert tight.ejection_time(3) == 5


def test_half_open_limits_probes_and_frees_slots():
    b = CircuitBreaker()
    _fail(b, 5, 0.0)
    assert b.allow(5.0)
    assert not b.allow(5.0)
    assert not b.available(6.0)
    b.release(6.0)
    assert b.available(6.0)
    assert b.allow(6.0)
    assert not b.allow(65.9)
    assert b.allow(66.0)  # the probe from 6.0 timed out without a verdict


def test_half_open_success_closes_and_starts_clean():
    b = CircuitBreaker()
    _fail(b, 5, 0.0)
    assert b.allow(5.0)
    b.record_success(6.0)
    assert b.state(6.0) is BreakerState.CLOSED
    assert b.consecutive_failures == 0
    # The failures that opened it are forgotten: four more do not reach five in a row.
    assert _fail(b, 4, 6.0) == [False] * 4
    assert b.record_failure(6.0) is True


def test_several_probe_successes_may_be_required():
    b = CircuitBreaker(BreakerConfig(half_open_probes=2, half_open_successes=2))
    _fail(b, 5, 0.0)
    assert b.allow(5.0) and b.allow(5.0) and not b.allow(5.0)
    b.record_success(5.5)
    assert b.state(5.5) is BreakerState.HALF_OPEN
    b.record_success(5.6)
    assert b.state(5.6) is BreakerState.CLOSED


def test_results_while_open_are_ignored():
    b = CircuitBreaker()
    _fail(b, 5, 0.0)
    assert b.record_failure(1.0) is False
    b.record_success(2.0)
    assert b.state(2.0) is BreakerState.OPEN
    assert b.open_until == 5.0
    b.release(2.0)  # no probe, no effect
    assert b.state(2.0) is BreakerState.OPEN


def test_ejection_count_decays_while_closed():
    def breaker_with_three_ejections() -> tuple[CircuitBreaker, float]:
        b = CircuitBreaker(BreakerConfig(ejection_decay_s=60.0))
        now = 0.0
        _fail(b, 5, now)
        for _ in range(2):
            now = b.open_until
            b.allow(now)
            b.record_failure(now)
        now = b.open_until  # 5 + 10 + 20 = 35
        b.allow(now)
        b.record_success(now)
        assert (now, b.ejections, b.state(now)) == (35.0, 3, BreakerState.CLOSED)
        return b, now

    b, closed_at = breaker_with_three_ejections()
    _fail(b, 5, closed_at + 59)
    assert b.open_until - b.opened_at == 40  # 4th recent ejection
    b, closed_at = breaker_with_three_ejections()
    _fail(b, 5, closed_at + 61)
    assert b.open_until - b.opened_at == 20  # one forgiven: 3rd
    b, closed_at = breaker_with_three_ejections()
    _fail(b, 5, closed_at + 3600)
    assert b.open_until - b.opened_at == 5  # all forgiven
    assert b.ejections_total == 4


def test_can_open_false_keeps_it_closed_but_counting():
    b = CircuitBreaker()
    assert [b.record_failure(0.0, can_open=False) for _ in range(7)] == [False] * 7
    assert b.state(0.0) is BreakerState.CLOSED
    assert b.record_failure(0.0) is True


# ---------------------------------------------------------------------------------------------
# Replica ejection cap
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "percent", "cap"),
    [(0, 50, 0), (1, 50, 0), (2, 50, 1), (3, 50, 1), (4, 50, 2), (5, 50, 2), (10, 10, 1), (5, 10, 1),
     (5, 0, 0), (3, 100, 3), (10, 30, 3)],
)  # fmt: skip
def test_max_ejected(n, percent, cap):
    ej = ReplicaEjector(BreakerConfig(max_ejection_percent=percent))
    ej.sync(f"r{i}" for i in range(n))
    assert ej.max_ejected() == cap


def test_ejection_cap_holds_back_a_third_ejection():
    ej = ReplicaEjector()
    ej.sync(["r0", "r1", "r2", "r3"])
    for r in ("r0", "r1"):
        assert [ej.record_failure(r, 0.0) for _ in range(5)][-1] is True
    assert [ej.record_failure("r2", 0.0) for _ in range(8)] == [False] * 8
    assert ej.states(0.0) == {
        "r0": BreakerState.OPEN,
        "r1": BreakerState.OPEN,
        "r2": BreakerState.CLOSED,
        "r3": BreakerState.CLOSED,
    }
    assert ej.routable(0.0) == ["r2", "r3"]
    # Half-open still counts as ejected: r2 stays in.
    assert ej.routable(5.0) == ["r0", "r1", "r2", "r3"]
    assert ej.record_failure("r2", 5.0) is False
    # A failed probe re-opens r0 although the cap is reached.
    assert ej.breaker("r0").allow(5.0)
    assert ej.record_failure("r0", 5.0) is True
    assert ej.routable(5.0) == ["r1", "r2", "r3"]
    # r1 recovers: room for r2, whose next failure ejects it at once (it kept counting).
    assert ej.breaker("r1").allow(5.0)
    ej.record_success("r1", 5.0)
    assert ej.record_failure("r2", 5.0) is True
    assert sorted(ej.ejected(5.0)) == ["r0", "r2"]


def test_single_replica_is_left_to_the_backend_breaker():
    ej = ReplicaEjector()
    ej.sync(["only"])
    assert [ej.record_failure("only", 0.0) for _ in range(10)] == [False] * 10
    assert ej.routable(0.0) == ["only"]


def test_sync_keeps_known_replicas_and_forgets_gone_ones():
    ej = ReplicaEjector()
    ej.sync(["a", "b", "c"])
    for _ in range(5):
        ej.record_failure("a", 0.0)
    kept = ej.breaker("a")
    ej.sync(["a", "c", "d"])
    assert ej.breaker("a") is kept
    assert ej.states(1.0) == {"a": BreakerState.OPEN, "c": BreakerState.CLOSED, "d": BreakerState.CLOSED}
    assert ej.routable(1.0) == ["c", "d"]


def test_routable_hides_half_open_with_its_probe_taken():
    ej = ReplicaEjector()
    ej.sync(["a", "b"])
    for _ in range(5):
        ej.record_failure("a", 0.0)
    assert ej.routable(5.0) == ["a", "b"]
    assert ej.breaker("a").allow(5.0)
    assert ej.routable(5.0) == ["b"]


# ---------------------------------------------------------------------------------------------
# Board
# ---------------------------------------------------------------------------------------------


def test_board_records_backend_and_replica():
    board = BreakerBoard()
    board.replicas("vllm").sync(["v0", "v1", "v2", "v3"])
    for _ in range(5):
        board.record("vllm", "v0", ok=False, now=0.0)
        board.record("vllm", "v1", ok=True, now=0.0)
    board.record("prov", None, ok=True, now=0.0)
    # The backend saw 5 failures and 5 successes interleaved: no streak, 10 < 20 requests.
    assert board.backend("vllm").state(0.0) is BreakerState.CLOSED
    assert board.replicas("vllm").states(0.0)["v0"] is BreakerState.OPEN
    assert sorted(board.metrics(0.0)) == [
        ("prov", "", 0),
        ("vllm", "", 0),
        ("vllm", "v0", 1),
        ("vllm", "v1", 0),
        ("vllm", "v2", 0),
        ("vllm", "v3", 0),
    ]
    for _ in range(5):
        board.record("prov", None, ok=False, now=1.0)
    assert board.backends(["prov", "vllm"])["prov"].state(1.0) is BreakerState.OPEN
    assert ("prov", "", 1) in board.metrics(1.0)


def test_board_admit_takes_the_half_open_probe():
    """The board alone takes a replica's half-open probe when an attempt goes there."""
    board = BreakerBoard()
    board.replicas("vllm").sync(["v0", "v1"])
    for _ in range(5):
        board.record("vllm", "v0", ok=False, now=0.0)
    b = board.replicas("vllm").breakers["v0"]
    assert b.state(5.0) is BreakerState.HALF_OPEN and b.available(5.0)
    board.admit("vllm", "v1", 5.0)  # closed: nothing taken
    board.admit("vllm", "gone", 5.0)  # unknown replica: ignored
    assert b.available(5.0)
    board.admit("vllm", "v0", 5.0)
    assert not b.available(5.0)  # its one probe slot is taken


# ---------------------------------------------------------------------------------------------
# Retry budget
# ---------------------------------------------------------------------------------------------


def test_retry_budget_minimum_without_traffic():
    rb = RetryBudget()
    assert rb.available(0.0) == 10.0
    assert [rb.try_spend(0.0) for _ in range(11)] == [True] * 10 + [False]
    assert rb.try_spend(9.9) is False
    assert rb.try_spend(10.0) is True  # the first slot slid out


def test_retry_budget_share_of_requests():
    rb = RetryBudget(RetryBudgetConfig(ratio=0.2, min_per_s=0.0))
    for _ in range(4):
        rb.deposit(0.0)
    assert rb.try_spend(0.0) is False  # 0.8 of a retry
    rb.deposit(0.0)
    assert rb.try_spend(0.0) is True
    assert rb.try_spend(0.0) is False
    for _ in range(100):
        rb.deposit(1.0)
    assert rb.available(1.0) == pytest.approx(20.0)
    assert sum(rb.try_spend(1.0) for _ in range(50)) == 20


def test_retry_budget_stops_a_retry_storm():
    # 50 requests per second for 100 s, every one fails and wants a retry.
    rb = RetryBudget()
    requests = retries = 0
    per_window: dict[int, int] = {}
    for tick in range(10_000):
        now = tick * 0.01
        if tick % 2 == 0:
            rb.deposit(now)
            requests += 1
            if rb.try_spend(now):
                retries += 1
                per_window[int(now // 10)] = per_window.get(int(now // 10), 0) + 1
    assert requests == 5000
    assert max(per_window.values()) <= 0.2 * 500 + 10
    assert 0.19 <= retries / requests <= 0.2 + 10 * 10 / requests


# ---------------------------------------------------------------------------------------------
# Failover plan
# ---------------------------------------------------------------------------------------------


def _opened(at: float) -> CircuitBreaker:
    b = CircuitBreaker()
    for _ in range(5):
        b.record_failure(at)
    return b


def test_plan_tries_candidates_in_order_once():
    plan = FailoverPlan(["a", "b", "c"])
    got = [plan.next(0.0, {}) for _ in range(4)]
    assert got == [PlannedAttempt("a", 0), PlannedAttempt("b", 1), PlannedAttempt("c", 2), None]
    assert plan.stop_reason == "exhausted"
    assert plan.tried == ["a", "b", "c"]


def test_plan_dedupes_candidates():
    plan = FailoverPlan(["a", "a", "b"])
    assert [p.backend for p in iter(lambda: plan.next(0.0, {}), None)] == ["a", "b"]


def test_plan_skips_open_breakers():
    breakers = {"a": _opened(0.0), "b": CircuitBreaker(), "c": CircuitBreaker()}
    plan = FailoverPlan(["a", "b", "c"])
    assert plan.next(1.0, breakers) == PlannedAttempt("b", 0)
    assert plan.next(1.0, breakers) == PlannedAttempt("c", 1)
    # 'a' is still open and untried: the fallback tries it rather than fail.
    assert plan.next(1.0, breakers) == PlannedAttempt("a", 2, forced=True)
    assert plan.next(1.0, breakers) is None


def test_plan_all_open_tries_the_least_recently_opened():
    breakers = {"a": _opened(3.0), "b": _opened(1.0), "c": _opened(2.0)}
    plan = FailoverPlan(["a", "b", "c"])
    assert plan.next(4.0, breakers) == PlannedAttempt("b", 0, forced=True)
    assert plan.next(4.0, breakers) == PlannedAttempt("c", 1, forced=True)
    # The forced attempt took no probe slot and left the breaker open.
    assert breakers["b"].state(4.0) is BreakerState.OPEN


def test_plan_can_refuse_to_try_open_breakers():
    breakers = {"a": _opened(0.0)}
    plan = FailoverPlan(["a"], config=FailoverConfig(try_open_when_all_open=False))
    assert plan.next(1.0, breakers) is None
    assert plan.stop_reason == "exhausted"


def test_plan_takes_the_half_open_probe_slot():
    breakers = {"a": _opened(0.0), "b": CircuitBreaker()}
    first = FailoverPlan(["a", "b"])
    assert first.next(5.0, breakers) == PlannedAttempt("a", 0)  # half-open, probe admitted
    second = FailoverPlan(["a", "b"])
    assert second.next(5.0, breakers) == PlannedAttempt("b", 0)  # probe slot taken


def test_plan_respects_the_deadline():
    plan = FailoverPlan(["a", "b"], deadline=10.0)
    assert plan.next(9.5, {}) == PlannedAttempt("a", 0)
    assert plan.next(9.51, {}) is None
    assert plan.stop_reason == "deadline"
    loose = FailoverPlan(["a"], deadline=10.0, config=FailoverConfig(min_attempt_s=0))
    assert loose.next(10.0, {}) is not None


def test_plan_max_attempts():
    plan = FailoverPlan(["a", "b", "c"], config=FailoverConfig(max_attempts=2))
    assert [plan.next(0.0, {}).backend, plan.next(0.0, {}).backend] == ["a", "b"]
    assert plan.next(0.0, {}) is None
    assert plan.stop_reason == "max_attempts"


def test_plan_charges_retries_not_first_attempts_or_hedges():
    budget = RetryBudget(RetryBudgetConfig(ratio=0.0, min_per_s=0.1, window_s=10.0))  # 1 retry
    plan = FailoverPlan(["a", "b", "c", "d"], retry_budget=budget)
    assert plan.next(0.0, {}).backend == "a"  # first attempt: free
    assert plan.next(0.0, {}, hedge=True).backend == "b"  # hedge: free
    assert plan.next(0.0, {}).backend == "c"  # retry: takes the one retry
    assert plan.next(0.0, {}) is None
    assert plan.stop_reason == "retry_budget"
    assert plan.tried == ["a", "b", "c"]


def test_plan_does_not_charge_the_budget_when_nothing_is_left():
    budget = RetryBudget(RetryBudgetConfig(ratio=0.0, min_per_s=0.1, window_s=10.0))
    plan = FailoverPlan(["a"], retry_budget=budget)
    plan.next(0.0, {})
    assert plan.next(0.0, {}) is None
    assert plan.stop_reason == "exhausted"
    assert budget.try_spend(0.0) is True


def test_retry_budget_has_the_request_budget_shape_and_a_refund_gives_room_back() -> None:
    from cluster.policy.failover import RetryBudget, RetryBudgetConfig
    from cluster.policy.request_budget import RequestBudget

    rb: RequestBudget = RetryBudget(RetryBudgetConfig(ratio=0.5, min_per_s=0.0, window_s=10.0))
    rb.deposit(0.0)
    rb.deposit(0.0)
    assert rb.try_spend(0.0) is True
    assert rb.try_spend(0.0) is False  # 2 requests x 0.5 = one retry, spent
    rb.refund(0.0)
    assert rb.try_spend(0.0) is True
