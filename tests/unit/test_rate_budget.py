"""One rate-budget interface (cluster.policy.rate_budget), two limiters behind it: the tenants' token
buckets and a provider's sliding windows. The same calls drive both; where the limits differ (what
a cancelled request gives back, when room comes again) each keeps its own answer."""

from __future__ import annotations

import pytest

from cluster.config import ProviderConfig, TenantConfig
from cluster.policy.rate_budget import RateLimiter, Refusal, Reservation
from cluster.policy.tenants import TenantBudgets
from cluster.policy.token_bucket import BucketBudget
from cluster.providers.budget import ProviderBudget
from deployments.budgets.budget_deployment import LocalBudget, budget_of


def _limiters(rpm: int = 2) -> dict[str, RateLimiter]:
    """``rpm`` requests a minute and 1,000 tokens, as a token bucket and as a sliding window."""
    return {
        "bucket": BucketBudget(rpm=rpm, tpm=1000, now=0.0),
        "window": ProviderBudget(rpm=rpm, tpm=1000, window_s=60.0),
    }


@pytest.mark.parametrize("kind", ["bucket", "window"])
def test_reserve_settle_cancel_through_one_interface(kind: str) -> None:
    b = _limiters(rpm=10)[kind]
    r = b.reserve("r1", 300, 300, 0.0)
    assert r == Reservation("r1", 600)
    refused = b.reserve("r2", 300, 300, 0.0)  # 600 + 600 > 1,000: neither the request nor its tokens
    assert isinstance(refused, Refusal) and refused.reason == "tpm" and refused.retry_after_s
    b.settle(r, 100, 1.0)  # used 100 of 600: the rest comes back
    r2 = b.reserve("r2", 300, 300, 1.0)
    assert isinstance(r2, Reservation)
    too_big = b.reserve("r3", 1000, 1, 1.0)
    assert isinstance(too_big, Refusal) and too_big.reason == "too_large" and too_big.retry_after_s is None
    assert b.snapshot(1.0)


def test_a_cancelled_request_gives_back_what_its_kind_of_limit_gives_back() -> None:
    """A token bucket gives the request back; a window keeps the admission counted until it leaves
    the window, as the provider counts it."""
    got = {}
    for kind, b in _limiters().items():
        r1, r2 = b.reserve("a", 1, 1, 0.0), b.reserve("b", 1, 1, 0.0)
        assert isinstance(r1, Reservation) and isinstance(r2, Reservation)
        b.cancel(r2, 0.0)
        got[kind] = b.reserve("c", 1, 1, 0.0)
    assert isinstance(got["bucket"], Reservation)
    window = got["window"]
    assert isinstance(window, Refusal) and window.reason == "rpm"
    assert window.retry_after_s == pytest.approx(60.0)  # when the first admission leaves the window


def test_the_tenants_budgets_are_one_limiter_keyed_by_tenant() -> None:
    b = TenantBudgets([TenantConfig(name="a", rpm=1), TenantConfig(name="free")], 0.0)
    assert b.budgeted() == {"a"} and b.reserve("free", 1, 1, 0.0) is None  # no budget: nothing held
    r = b.reserve("a", 5, 5, 0.0)
    assert r == Reservation("a", 10)
    refused = b.reserve("a", 5, 5, 0.0)
    assert isinstance(refused, Refusal) and refused.all_refused_s == pytest.approx(60.0)
    b.cancel(r, 0.0)
    assert isinstance(b.reserve("a", 5, 5, 0.0), Reservation)
    assert b.snapshot(0.0) == {"a.rpm_level": 0.0, "a.tpm_level": None}


async def test_the_shared_budget_holds_either_limiter() -> None:
    tenants = budget_of(tenants=[{"name": "a", "rpm": 1}])
    provider = budget_of(provider=ProviderConfig(api="openai", base_url="http://x", rpm=1).model_dump())
    assert isinstance(tenants, TenantBudgets) and isinstance(provider, ProviderBudget)
    local = LocalBudget(tenants)
    r = await local.reserve("a", 1, 1, wait_s=0.0)
    assert isinstance(r, Reservation)
    assert isinstance(await local.reserve("a", 1, 1, wait_s=0.0), Refusal)  # no wait asked: at once
    await local.cancel(r)
    assert isinstance(await local.reserve("a", 1, 1), Reservation)
