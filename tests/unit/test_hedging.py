import random
import statistics

import pytest
from pydantic import ValidationError

from cluster.policy.hedging import (
    HedgeBudget,
    HedgeConfig,
    HedgePolicy,
    HedgeStats,
    QuantileSketch,
    TtftTracker,
    hedge_delay,
    should_hedge,
)


def _truth(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics, as numpy's default."""
    if q == 0:
        return min(values)
    if q == 1:
        return max(values)
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return cuts[round(q * 1000) - 1]


# ---------------------------------------------------------------------------------------------
# Sketch
# ---------------------------------------------------------------------------------------------


def test_sketch_is_cold_below_min_samples():
    s = QuantileSketch(capacity=100, min_samples=5)
    for i in range(4):
        s.observe(float(i), now=0.0)
        assert s.quantile(0.5, 0.0) is None
    s.observe(4.0, now=0.0)
    assert s.quantile(0.5, 0.0) == 2.0
    assert s.count(0.0) == 5


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sketch_quantiles_match_the_sorted_truth(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(-1.0, 0.8) for _ in range(200)]
    s = QuantileSketch(capacity=256, min_samples=1)
    for i, v in enumerate(values):
        s.observe(v, now=i * 0.01)
    for q in (0.0, 0.01, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0):
        assert s.quantile(q, 2.0) == pytest.approx(_truth(values, q), rel=1e-12)


def test_sketch_interpolates_exactly():
    s = QuantileSketch(min_samples=1)
    for v in (10.0, 30.0, 20.0, 40.0):
        s.observe(v, 0.0)
    # Sorted: 10 20 30 40; position q * 3.
    assert s.quantile(0.5, 0.0) == 25.0
    assert s.quantile(0.95, 0.0) == pytest.approx(38.5)
    assert s.quantile(1 / 3, 0.0) == pytest.approx(20.0)


def test_sketch_keeps_only_the_last_capacity_samples():
    rng = random.Random(7)
    values = [rng.random() for _ in range(1000)]
    s = QuantileSketch(capacity=128, min_samples=1)
    for i, v in enumerate(values):
        s.observe(v, now=float(i) * 0.001)
    assert s.count(1.0) == 128
    for q in (0.05, 0.5, 0.95):
        assert s.quantile(q, 1.0) == pytest.approx(_truth(values[-128:], q), rel=1e-12)


def test_sketch_forgets_old_samples():
    s = QuantileSketch(capacity=100, max_age_s=60.0, min_samples=3)
    for v in (100.0, 100.0, 100.0):
        s.observe(v, now=0.0)
    for v in (1.0, 2.0, 3.0):
        s.observe(v, now=30.0)
    assert s.quantile(1.0, 59.9) == 100.0
    assert s.quantile(1.0, 60.0) == 3.0  # the samples from 0.0 are 60 s old: gone
    assert s.count(60.0) == 3
    assert s.quantile(0.5, 90.0) is None  # all gone: cold again


def test_sketch_sees_a_slowdown_within_capacity():
    s = QuantileSketch(capacity=50, min_samples=10)
    for i in range(50):
        s.observe(0.2, now=i)
    assert s.quantile(0.95, 50) == 0.2
    for i in range(50, 100):
        s.observe(2.0, now=i)
    assert s.quantile(0.05, 100) == 2.0


def test_tracker_keys_by_surface_and_backend():
    t = TtftTracker(HedgeConfig(min_samples=1))
    t.observe("tab", "vllm", 0.1, 0.0)
    t.observe("chat", "vllm", 0.9, 0.0)
    t.observe("tab", "openai", 0.5, 0.0)
    assert t.quantile("tab", "vllm", 0.5, 0.0) == 0.1
    assert t.quantile("chat", "vllm", 0.5, 0.0) == 0.9
    assert t.quantile("tab", "openai", 0.5, 0.0) == 0.5
    assert t.quantile("agent", "vllm", 0.5, 0.0) is None
    assert t.sketch("tab", "vllm") is t.sketch("tab", "vllm")


# ---------------------------------------------------------------------------------------------
# Delay
# ---------------------------------------------------------------------------------------------


def test_config_defaults_and_validation():
    c = HedgeConfig()
    assert (c.quantile, c.budget_ratio, c.fixed_delay_s, c.max_hedges) == (0.95, 0.05, None, 1)
    with pytest.raises(ValidationError, match="min_delay_s"):
        HedgeConfig(min_delay_s=2.0, max_delay_s=1.0)
    with pytest.raises(ValidationError):
        HedgeConfig(quantile=1.0)
    with pytest.raises(ValidationError):
        HedgeConfig(budget_burst=0.5)
    with pytest.raises(ValidationError):
        HedgeConfig(delay=1.0)


@pytest.mark.parametrize(
    ("cfg", "observed", "delay"),
    [
        (HedgeConfig(), None, None),  # cold, no fixed delay: no hedge
        (HedgeConfig(fixed_delay_s=0.8), None, 0.8),  # cold: the fixed delay
        (HedgeConfig(fixed_delay_s=0.8), 0.3, 0.3),  # warm: the quantile wins
        (HedgeConfig(min_delay_s=0.05, max_delay_s=5.0), 0.01, 0.05),
        (HedgeConfig(min_delay_s=0.05, max_delay_s=5.0), 9.0, 5.0),
        (HedgeConfig(min_delay_s=0.05, max_delay_s=5.0), 1.25, 1.25),
        (HedgeConfig(quantile=None, fixed_delay_s=0.4), 3.0, 0.4),  # fixed only
        (HedgeConfig(quantile=None), 3.0, None),
    ],
)
def test_hedge_delay(cfg, observed, delay):
    assert hedge_delay(cfg, observed) == delay


# ---------------------------------------------------------------------------------------------
# Budget and decision
# ---------------------------------------------------------------------------------------------


def test_budget_needs_twenty_requests_per_hedge():
    b = HedgeBudget(ratio=0.05, burst=3.0)
    assert not b.try_spend()
    for _ in range(19):
        b.deposit()
    assert not b.try_spend()
    b.deposit()
    assert b.tokens == 1.0
    assert b.try_spend()
    assert b.tokens == 0.0
    assert not b.try_spend()


def test_budget_burst_cap():
    b = HedgeBudget(ratio=0.05, burst=3.0)
    for _ in range(10_000):
        b.deposit()
    assert b.tokens == 3.0
    assert [b.try_spend() for _ in range(4)] == [True, True, True, False]


def test_budget_holds_five_percent_over_a_long_run():
    rng = random.Random(11)
    b = HedgeBudget(ratio=0.05, burst=3.0)
    requests = hedges = 0
    for _ in range(200_000):
        b.deposit()
        requests += 1
        # Most requests are slow enough to want a hedge, in bursts.
        while rng.random() < 0.6 and b.try_spend():
            hedges += 1
        assert hedges <= 0.05 * requests + 1e-9
    assert hedges / requests == pytest.approx(0.05, abs=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"enabled": False, "elapsed_s": 5.0, "delay_s": 1.0}, False),
        ({"enabled": True, "elapsed_s": 5.0, "delay_s": None}, False),
        ({"enabled": True, "elapsed_s": 0.99, "delay_s": 1.0}, False),
        ({"enabled": True, "elapsed_s": 1.0, "delay_s": 1.0}, True),
        ({"enabled": True, "elapsed_s": 5.0, "delay_s": 1.0, "hedges_sent": 1}, False),
        ({"enabled": True, "elapsed_s": 5.0, "delay_s": 1.0, "hedges_sent": 1, "max_hedges": 2}, True),
        ({"enabled": True, "elapsed_s": 5.0, "delay_s": 1.0, "max_hedges": 0}, False),
    ],
)
def test_should_hedge_conditions(kwargs, expected):
    b = HedgeBudget(ratio=1.0, burst=1.0)
    b.deposit()
    assert should_hedge(budget=b, **kwargs) is expected
    assert b.tokens == (0.0 if expected else 1.0)  # only a yes spends


def test_should_hedge_refuses_without_budget():
    b = HedgeBudget()
    assert should_hedge(True, 10.0, 1.0, b) is False


# ---------------------------------------------------------------------------------------------
# Stats and the policy object
# ---------------------------------------------------------------------------------------------


def test_stats_extra_load_ratio():
    s = HedgeStats()
    assert s.extra_load_ratio == 0.0
    for _ in range(100):
        s.on_request()
    for _ in range(4):
        s.on_hedge()
    s.on_retry()
    s.on_hedge_result(won=True)
    for _ in range(3):
        s.on_hedge_result(won=False)
    assert (s.requests, s.attempts, s.hedges_sent, s.hedges_won, s.hedges_cancelled) == (100, 105, 4, 1, 3)
    assert s.extra_load_ratio == pytest.approx(0.05)


def test_policy_end_to_end():
    p = HedgePolicy(HedgeConfig(min_samples=20, min_delay_s=0.01, max_delay_s=10.0))
    assert p.delay("tab", "vllm", 0.0) is None  # cold
    for i in range(100):
        p.observe_ttft("tab", "vllm", (i + 1) / 100, now=float(i))
    assert p.delay("tab", "vllm", 100.0) == pytest.approx(0.9505)  # 0.01..1.00, position 94.05
    assert p.delay("chat", "vllm", 100.0) is None
    delay = p.delay("tab", "vllm", 100.0)
    assert not p.should_hedge(True, 2.0, delay)  # no budget yet
    for _ in range(20):
        p.on_request()
    assert not p.should_hedge(True, 0.5, delay)
    assert p.should_hedge(True, 1.0, delay)
    assert not p.should_hedge(True, 1.0, delay, hedges_sent=1)
    assert (p.stats.requests, p.stats.hedges_sent, p.stats.attempts) == (20, 1, 21)
    assert p.stats.extra_load_ratio == pytest.approx(0.05)
    # due twice (elapsed past the delay): the first no-budget refusal was counted, and this one
    assert not p.should_hedge(True, 1.0, delay)
    assert p.stats.hedges_refused == 2
    assert p.delays(100.0) == {"tab/vllm": pytest.approx(0.9505), "chat/vllm": None}


def test_policy_with_fixed_delay_only():
    p = HedgePolicy(HedgeConfig(quantile=None, fixed_delay_s=0.25))
    for i in range(100):
        p.observe_ttft("tab", "vllm", 5.0, now=float(i))
    assert p.delay("tab", "vllm", 100.0) == 0.25


def test_a_hedge_that_found_no_candidate_is_neither_paid_nor_counted() -> None:
    p = HedgePolicy(HedgeConfig(budget_ratio=0.5, budget_burst=2.0))
    p.on_request()
    p.on_request()  # one token
    assert p.should_hedge(True, 1.0, 0.5) and p.budget.tokens == 0.0
    p.unsent()
    assert p.budget.tokens == 1.0
    assert (p.stats.hedges_sent, p.stats.hedges_unplaced, p.stats.attempts) == (0, 1, 2)
    assert p.stats.extra_load_ratio == 0.0


def test_hedge_budget_has_the_request_budget_shape() -> None:
    from cluster.policy.request_budget import RequestBudget

    b: RequestBudget = HedgeBudget(ratio=0.5, burst=3.0)
    b.deposit(0.0)
    b.deposit(1.0)
    assert b.try_spend(2.0) is True
    assert b.try_spend(2.0) is False
    b.refund(3.0)
    assert b.try_spend(3.0) is True
