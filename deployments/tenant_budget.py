"""Where the tenants' request and token budgets live: one count per app, whatever the gateways.

Each gateway replica used to hold ``1 / gateway_replicas`` of every tenant's budget: exact only when
HAProxy spreads a tenant's requests evenly, and short of the budget otherwise (a tenant of 3 RPM
behind 2 gateways got 2 in a burst). In a Serve app the budgets are one deployment of the app
(``tenant-budgets``, one replica, no CPU: it only counts), which every gateway replica asks, as the
provider budgets are (:mod:`deployments.budget_deployment`). A request of a tenant with no budget
never calls it; one that does pays one call before admission, and its settlement is sent without
waiting. Should the deployment be unreachable, the request is admitted (the budgets are a fairness
control; the providers' own limits still hold) and the failure is logged.

Without Serve (unit tests, one process) the budgets are an in-process object. Both speak the same
async interface; the pure accounting is :class:`cluster.policy.tenants.TenantBudgets`. Both also
remember (:class:`cluster.policy.tenants.KnownOut`) a tenant whose requests per minute are spent
until a known time: its next requests are refused by :meth:`refusal` before they are parsed,
tokenized or sent to the deployment (a runaway loop's 429s cost the gateway almost nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve

from cluster.config import TenantConfig
from cluster.policy.tenants import KnownOut, TenantBudgets, TenantReservation
from cluster.wire.errors import RateLimited

log = logging.getLogger("ray.serve")
Reserved = TenantReservation | RateLimited | None


class LocalTenants:
    """The budgets in this process."""

    def __init__(self, budgets: TenantBudgets) -> None:
        self._b = budgets
        self.out = KnownOut()

    def refusal(self, tenant: str | None) -> RateLimited | None:
        return self.out.refusal(tenant, time.monotonic())

    async def reserve(self, tenant: str | None, input_tokens: int, max_tokens: int) -> Reserved:
        got = self._b.reserve(tenant, input_tokens, max_tokens, time.monotonic())
        if isinstance(got, RateLimited) and tenant is not None:
            self.out.note(tenant, got, time.monotonic())
        return got

    def settle(self, res: TenantReservation, actual_tokens: int) -> None:
        self._b.settle(res, actual_tokens, time.monotonic())

    def cancel(self, res: TenantReservation) -> None:
        self._b.cancel(res, time.monotonic())


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class TenantBudgetDeployment:
    """The app's one copy of the budgets: :class:`LocalTenants` behind Serve's handle."""

    def __init__(self, tenants: list[dict[str, Any]]) -> None:
        cfgs = [TenantConfig.model_validate(t) for t in tenants]
        self._local = LocalTenants(TenantBudgets(cfgs, time.monotonic()))

    async def reserve(self, tenant: str, input_tokens: int, max_tokens: int) -> Reserved:
        return await self._local.reserve(tenant, input_tokens, max_tokens)

    async def settle(self, res: TenantReservation, actual_tokens: int) -> None:
        self._local.settle(res, actual_tokens)

    async def cancel(self, res: TenantReservation) -> None:
        self._local.cancel(res)


class ServeTenants:
    """The app's ``tenant-budgets`` deployment, through its handle."""

    def __init__(self, handle: Any, budgeted: set[str]) -> None:
        self._h = handle
        self._budgeted = budgeted
        self._pending: set[asyncio.Task[Any]] = set()
        self.out = KnownOut()

    def refusal(self, tenant: str | None) -> RateLimited | None:
        return self.out.refusal(tenant, time.monotonic())

    async def reserve(self, tenant: str | None, input_tokens: int, max_tokens: int) -> Reserved:
        if tenant is None or tenant not in self._budgeted:
            return None
        try:
            got = await self._h.reserve.remote(tenant, input_tokens, max_tokens)
        except Exception as exc:  # unreachable: admit, as without budgets
            log.warning("tenant budgets unreachable, admitting tenant %r unbudgeted: %r", tenant[:64], exc)
            return None
        if isinstance(got, RateLimited):
            self.out.note(tenant, got, time.monotonic())
        return got

    def settle(self, res: TenantReservation, actual_tokens: int) -> None:
        self._send(self._h.settle.remote(res, actual_tokens))

    def cancel(self, res: TenantReservation) -> None:
        self._send(self._h.cancel.remote(res))

    def _send(self, response: Any) -> None:
        async def wait() -> None:
            try:
                await response
            except Exception as exc:
                log.warning("tenant budget settlement lost: %r", exc)

        task = asyncio.get_running_loop().create_task(wait())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


def tenant_budgets(tenants: list[TenantConfig], handle: Any | None) -> LocalTenants | ServeTenants:
    """The app's shared budgets when the app has the deployment, else this process's own."""
    if handle is None:
        return LocalTenants(TenantBudgets(tenants, time.monotonic()))
    return ServeTenants(handle, {t.name for t in tenants if t.rpm is not None or t.tpm is not None})
