"""Tenants: who pays for a request. API keys carry a tenant (config); each tenant may have request
and token budgets per minute and a fair-queuing weight (used by admission, :mod:`cluster.policy.admission`).

Budgets are token buckets (:class:`cluster.policy.token_bucket.BucketBudget`) holding a minute's worth:
a request reserves one request and ``prompt tokens + max_tokens`` before admission and settles with
its actual usage at the end (the unused part given back); a request refused by admission gives its
reservation back. Over budget: 429 with ``Retry-After`` = when the bucket has room again, so a
runaway agent loop of one tenant is refused at once while other tenants keep their share.

Several gateway replicas: in a Serve app these budgets are one object in one deployment of the app,
which every gateway replica asks (:mod:`deployments.tenant_budget`), so a tenant's budget is counted
once however HAProxy spreads its requests. ``router_replicas`` (a share per replica) remains for a
caller that keeps budgets per process. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cluster.config import TenantConfig
from cluster.policy.token_bucket import BucketBudget, Reservation
from cluster.wire.errors import RateLimited


@dataclass(frozen=True, slots=True)
class TenantReservation:
    tenant: str
    reservation: Reservation


class TenantBudgets:
    def __init__(self, tenants: Iterable[TenantConfig], now: float, *, router_replicas: int = 1) -> None:
        self._budgets = {
            t.name: BucketBudget(t.rpm, t.tpm, now, router_replicas=router_replicas)
            for t in tenants
            if t.rpm is not None or t.tpm is not None
        }

    def reserve(
        self, tenant: str | None, input_tokens: int, max_tokens: int, now: float
    ) -> TenantReservation | RateLimited | None:
        """A reservation, a 429 to send, or None when no budget applies (no tenant, or no limit)."""
        budget = self._budgets.get(tenant) if tenant is not None else None
        if budget is None or tenant is None:
            return None
        got = budget.try_reserve(input_tokens, max_tokens, now)
        if isinstance(got, RateLimited):
            return RateLimited(
                f"tenant '{tenant}' is over its budget: {got.message}", retry_after_s=got.retry_after_s
            )
        return TenantReservation(tenant, got)

    def settle(self, res: TenantReservation, actual_tokens: int, now: float) -> None:
        self._budgets[res.tenant].settle(res.reservation, actual_tokens, now)

    def cancel(self, res: TenantReservation, now: float) -> None:
        """Never served (refused by admission): the request and its tokens go back."""
        self._budgets[res.tenant].cancel(res.reservation, now)
