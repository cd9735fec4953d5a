"""The tenants' token buckets (cluster.policy.token_bucket): refill math, reserve both or neither, settle."""

from __future__ import annotations

import math

import pytest

from cluster.policy.rate_budget import Refusal, Reservation
from cluster.policy.token_bucket import BucketBudget, TokenBucket


def test_token_bucket_refill_math():
    b = TokenBucket(capacity=10, refill_per_s=2, now=0.0)
    assert b.level(0.0) == 10
    assert b.try_take(10, 0.0) and not b.try_take(1, 0.0)
    assert b.level(1.5) == pytest.approx(3.0)
    assert b.time_until(5, 1.5) == pytest.approx(1.0)
    assert b.time_until(3, 1.5) == 0.0
    assert b.time_until(11, 1.5) == math.inf
    assert not b.try_take(5, 1.5) and b.try_take(5, 2.5)
    assert b.level(100.0) == 10  # never above capacity
    b.give_back(4, 100.0)
    assert b.level(100.0) == 10
    assert b.level(50.0) == 10  # a clock stepping back refills nothing and takes nothing
    b.take(15, 100.0)  # an overrun: debt
    assert b.level(100.0) == -5
    assert b.time_until(1, 100.0) == pytest.approx(3.0)
    assert TokenBucket(5, 0, 0.0, level=1).time_until(2, 10.0) == math.inf
    with pytest.raises(ValueError):
        TokenBucket(0, 1, 0.0)


def test_bucket_budget_reserves_both_or_neither_and_settles():
    pb = BucketBudget(rpm=60, tpm=1000, now=0.0)
    r = pb.reserve("k", 400, 200, 0.0)
    assert r == Reservation("k", 600)
    denied = pb.reserve("k", 400, 200, 0.0)
    assert isinstance(denied, Refusal) and denied.reason == "tpm"
    assert denied.retry_after_s == pytest.approx((600 - 400) / (1000 / 60))
    assert pb.rpm.level(0.0) == 59  # the denied request took nothing
    pb.settle(r, 300, 0.0)  # used 300 of 600: 300 back
    assert pb.tpm.level(0.0) == pytest.approx(700)
    r2 = pb.reserve("k", 100, 100, 0.0)
    pb.settle(r2, 350, 0.0)  # overran by 150: debt
    assert pb.tpm.level(0.0) == pytest.approx(350)
    pb.cancel(pb.reserve("k", 50, 50, 0.0), 0.0)
    assert (pb.rpm.level(0.0), pb.tpm.level(0.0)) == (58, pytest.approx(350))  # 3 taken, 1 back
    too_big = pb.reserve("k", 900, 200, 0.0)
    assert isinstance(too_big, Refusal) and too_big.reason == "too_large" and too_big.retry_after_s is None


def test_bucket_budget_rpm_and_sharing():
    pb = BucketBudget(rpm=6, tpm=None, now=0.0, router_replicas=2)  # 3 per minute here
    assert [isinstance(pb.reserve("k", 1, 1, 0.0), Reservation) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    assert pb.reserve("k", 1, 1, 0.0).retry_after_s == pytest.approx(20.0)
    assert isinstance(pb.reserve("k", 1, 1, 20.0), Reservation)
    pb.settle(Reservation("k", 10), 1, 20.0)  # no TPM budget: nothing to settle
    free = BucketBudget(rpm=None, tpm=None, now=0.0)
    assert free.reserve("k", 10**9, 10**9, 0.0) == Reservation("k", 2 * 10**9)
    burst = BucketBudget(rpm=60_000, tpm=None, now=0.0, burst_s=1.0)
    assert burst.rpm.capacity == 1000
