"""Tenants: who pays for a request. API keys carry a tenant (config); each tenant may have request
and token budgets per minute and a fair-queuing weight (used by admission, :mod:`cluster.policy.admission`).

Budgets are token buckets (:class:`cluster.policy.token_bucket.BucketBudget`, one of the two
limiters behind :class:`cluster.policy.rate_budget.RateLimiter`) holding a minute's worth
(the request bucket ``burst_s`` seconds' worth, ``TenantConfig.burst_s``, 60 by default):
a request reserves one request and ``prompt tokens + max_tokens`` before admission and settles with
its actual usage at the end (the unused part given back), or, when it ends without usage (the
client left mid-stream), with the prompt and the tokens relayed (:func:`spent_tokens`); a request
refused by admission gives its reservation back. Over budget: 429 with ``Retry-After`` = when the
bucket has room again, so a runaway agent loop of one tenant is refused at once while other
tenants keep their share.

Several gateway replicas: in a Serve app these budgets are one object in one deployment of the app
(the shared-budget deployment, ``deployments/budgets/budget_deployment.py``), which every gateway replica
asks (:mod:`deployments.budgets.tenant_budget`), so a tenant's budget is counted
once however HAProxy spreads its requests. ``router_replicas`` (a share per replica) remains for a
caller that keeps budgets per process. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable

from cluster.config import TenantConfig
from cluster.policy.rate_budget import Refusal, Reservation, Snapshot
from cluster.policy.token_bucket import BucketBudget
from cluster.wire.errors import RateLimited, _rebuild
from cluster.wire.protocol import Usage


class OverBudget(RateLimited):
    """A tenant over its budget (429). ``all_refused_s``: how long every request of the tenant will
    be refused whatever its size (its request bucket is empty for that long; 0 when only its token
    budget refused this request, which a smaller one might pass)."""

    def __init__(self, message: str, *, all_refused_s: float = 0.0, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]  # RateLimited's own keywords, passed on
        self.all_refused_s = all_refused_s

    def __reduce__(self) -> tuple[object, ...]:  # crosses the budget deployment's Ray call
        _, (cls, message, kwargs) = super().__reduce__()
        return (_rebuild, (cls, message, {**kwargs, "all_refused_s": self.all_refused_s}))


class KnownOut:
    """What a gateway replica learnt from the budgets' refusals: tenants whose every request is
    refused until a known time. A request of such a tenant is refused before it is parsed and
    tokenized, without asking the budgets (one call to their deployment per request otherwise).
    Never refuses what the budget would admit, as its request bucket only refills by the clock;
    a request handed back (refused by admission after its reservation) may free one a little
    sooner, which this replica learns at its next ask."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def note(self, tenant: str, refusal: RateLimited, now: float) -> None:
        wait = getattr(refusal, "all_refused_s", 0.0)
        if wait > 0:
            self._until[tenant] = now + wait

    def refusal(self, tenant: str | None, now: float) -> RateLimited | None:
        if tenant is None or (until := self._until.get(tenant)) is None:
            return None
        if now >= until:
            del self._until[tenant]
            return None
        return RateLimited(
            f"tenant '{tenant}' is over its budget: its requests per minute are spent",
            retry_after_s=until - now,
        )


def spent_tokens(usage: Usage | None, prompt_tokens: int, relayed: int, sent: bool) -> int:
    """The tokens a served request's reservation settles with. Its usage when the backend reported
    one; else (the client left, the stream broke: no usage came) what it spent as far as the gateway
    saw, as the provider books count an unsettled stream: the prompt once an attempt was sent (the
    engine prefilled it) and the completion tokens relayed so far. Without that a tenant that always
    leaves after its first tokens gave its whole reservation back each time: no token limit at all.
    ``sent`` False (every attempt refused before a token, never sent): nothing is charged."""
    if usage is not None and usage.total_tokens > 0:
        return usage.total_tokens
    return prompt_tokens + max(relayed, 0) if sent else 0


TenantReservation = Reservation  # a tenant's reservation: ``key`` is the tenant


def over_budget(tenant: str, refusal: Refusal) -> OverBudget:
    """The 429 a tenant's refusal becomes (Retry-After: when this request would fit)."""
    return OverBudget(
        f"tenant '{tenant}' is over its budget: {refusal.message}",
        retry_after_s=refusal.retry_after_s,
        all_refused_s=refusal.all_refused_s,
    )


class TenantBudgets:
    """Every tenant's :class:`BucketBudget`, as one :class:`cluster.policy.rate_budget.RateLimiter`
    keyed by the tenant (None from ``reserve``: the tenant has no budget)."""

    def __init__(self, tenants: Iterable[TenantConfig], now: float, *, router_replicas: int = 1) -> None:
        self._budgets = {
            t.name: BucketBudget(
                t.rpm, t.tpm, now, router_replicas=router_replicas, request_burst_s=t.burst_s
            )
            for t in tenants
            if t.rpm is not None or t.tpm is not None
        }

    def budgeted(self) -> set[str]:
        """The tenants with a budget (the others never ask)."""
        return set(self._budgets)

    def reserve(
        self, tenant: str, input_tokens: int, max_tokens: int, now: float
    ) -> Reservation | Refusal | None:
        """A reservation, a refusal, or None when the tenant has no budget."""
        budget = self._budgets.get(tenant)
        return None if budget is None else budget.reserve(tenant, input_tokens, max_tokens, now)

    def settle(self, res: Reservation, tokens: int, now: float) -> None:
        self._budgets[res.key].settle(res, tokens, now)

    def cancel(self, res: Reservation, now: float) -> None:
        """Never served (refused by admission): the request and its tokens go back."""
        self._budgets[res.key].cancel(res, now)

    def snapshot(self, now: float) -> Snapshot:
        """Each budgeted tenant's bucket levels, as ``<tenant>.<level>``."""
        return {f"{t}.{k}": v for t, b in self._budgets.items() for k, v in b.snapshot(now).items()}
