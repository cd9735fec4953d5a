"""The shared-budget deployment, and the two ways to reach a rate budget: in this process or through it.

A budget that several gateway replicas draw from must be one count, so in a Serve app it lives in
a deployment of the app with one replica (no CPU: it only counts), which every gateway replica
asks: :class:`BudgetDeployment`, one class for both kinds of budget, deployed as
``tenant-budgets`` (every tenant's buckets) and as ``budget-<backend>`` for each provider backend
with a limit (:mod:`cluster.dataplane` names them). It is deployed, redeployed and deleted with its
app. If it dies Serve starts a new one with empty counts (the providers' own 429s cover the gap).

:class:`LocalBudget` holds a :class:`cluster.policy.rate_budget.RateLimiter` in this process (unit
and adapter tests, and inside the deployment) and adds the clock and the waiting: a ``reserve``
may wait up to ``wait_s`` for room, woken when a request ends or when the refusal said room comes.
:class:`ServeBudget` is the same interface through the deployment's handle: one call per reserve,
settle or cancel, never per chunk. What each side does with a refusal is its own: the tenants'
client (``deployments/budgets/tenant_budget.py``) and the provider adapter
(``deployments/providers/providers.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from ray import serve

from cluster.config import ProviderConfig, TenantConfig
from cluster.json_types import JSONObject
from cluster.policy.rate_budget import RateLimiter, Refusal, Reservation
from cluster.policy.tenants import TenantBudgets
from cluster.providers.budget import ProviderBudget
from cluster.wire.errors import BackendUnavailable

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

T = TypeVar("T")

Reserved = Reservation | Refusal | None


class Budget(Protocol):
    """A rate budget as the gateway's code calls it (here or in the shared deployment)."""

    async def reserve(
        self, key: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0
    ) -> Reserved: ...

    async def settle(self, reservation: Reservation, tokens: int) -> None: ...

    async def cancel(self, reservation: Reservation) -> None: ...

    def snapshot_now(self) -> JSONObject:
        """What the budget holds, read without waiting (empty where it lives in another process)."""
        ...


class LocalBudget:
    """A budget in this process. Waiters wake when a request ends or when the window frees room."""

    def __init__(self, limiter: RateLimiter, clock: Callable[[], float] = time.monotonic) -> None:
        self.limiter = limiter
        self._clock = clock
        self._changed: asyncio.Event | None = None
        self.waiting = 0

    async def reserve(self, key: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0) -> Reserved:
        give_up = self._clock() + max(0.0, wait_s)
        while True:
            got = self.limiter.reserve(key, input_tokens, max_tokens, self._clock())
            remaining = give_up - self._clock()
            if not isinstance(got, Refusal) or got.retry_after_s is None or remaining <= 0:
                return got
            changed = self._event()
            self.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(remaining, max(got.retry_after_s, 0.001)))
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        self.limiter.settle(reservation, tokens, self._clock())
        self.changed()

    async def cancel(self, reservation: Reservation) -> None:
        self.limiter.cancel(reservation, self._clock())
        self.changed()

    def snapshot(self) -> JSONObject:
        return {**self.limiter.snapshot(self._clock()), "waiting": self.waiting}

    def snapshot_now(self) -> JSONObject:
        return self.snapshot()

    def changed(self) -> None:
        """Room may have freed (a request ended, the limits changed): every waiter retries now."""
        # One event per generation: everyone waiting now retries; later waiters get a fresh one.
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


class ServeBudget:
    """A :class:`BudgetDeployment` through its Serve handle. ``what`` names it in errors; a replica
    that is gone is a :class:`BackendUnavailable` (for ``backend``, when it is a provider's)."""

    def __init__(self, what: str, handle: DeploymentHandle, backend: str | None = None) -> None:
        self.what, self.backend = what, backend
        self._handle = handle

    async def _call(self, call: Callable[[DeploymentHandle], Awaitable[T]]) -> T:
        """``call(handle)``: one method's ``.remote(...)`` on the deployment, awaited."""
        from ray.exceptions import RayError

        try:
            return await call(self._handle)
        except RayError as exc:  # died or restarting: Serve brings a new one up
            raise BackendUnavailable(
                f"{self.what}: its budget is unavailable ({type(exc).__name__})", backend=self.backend
            ) from exc

    async def reserve(self, key: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0) -> Reserved:
        got: Reserved = await self._call(lambda h: h.reserve.remote(key, input_tokens, max_tokens, wait_s))
        return got

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        await self._call(lambda h: h.settle.remote(reservation, tokens))

    async def cancel(self, reservation: Reservation) -> None:
        await self._call(lambda h: h.cancel.remote(reservation))

    async def snapshot(self) -> JSONObject:
        snap: JSONObject = await self._call(lambda h: h.snapshot.remote())
        return snap

    def snapshot_now(self) -> JSONObject:
        return {}  # the shared deployment's: only by a call (``snapshot``)


def budget_of(tenants: list[JSONObject] | None = None, provider: JSONObject | None = None) -> RateLimiter:
    """The limiter a shared budget holds: every tenant's buckets, or one provider backend's windows."""
    if provider is not None:
        return ProviderBudget.from_config(ProviderConfig.model_validate(provider))
    return TenantBudgets([TenantConfig.model_validate(t) for t in tenants or []], time.monotonic())


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class BudgetDeployment:
    """The app's one copy of a budget: :class:`LocalBudget` behind Serve's handle. Bound with
    ``tenants=`` (the config's tenants) or ``provider=`` (a backend's provider section)."""

    def __init__(self, tenants: list[JSONObject] | None = None, provider: JSONObject | None = None) -> None:
        self._local = LocalBudget(budget_of(tenants, provider))

    async def reserve(self, key: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0) -> Reserved:
        return await self._local.reserve(key, input_tokens, max_tokens, wait_s)

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        await self._local.settle(reservation, tokens)

    async def cancel(self, reservation: Reservation) -> None:
        await self._local.cancel(reservation)

    async def snapshot(self) -> JSONObject:
        return self._local.snapshot()
