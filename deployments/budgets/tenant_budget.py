"""Where the tenants' request and token budgets live: one count per app, whatever the gateways.

Each gateway replica used to hold ``1 / gateway_replicas`` of every tenant's budget: exact only when
HAProxy spreads a tenant's requests evenly, and short of the budget otherwise (a tenant of 3 RPM
behind 2 gateways got 2 in a burst). In a Serve app the budgets are the app's shared-budget
deployment (``tenant-budgets``, :class:`deployments.budgets.budget_deployment.BudgetDeployment`, as the
provider budgets are), which every gateway replica asks. A request of a tenant with no budget
never calls it; one that does pays one call before admission, and its settlement is sent without
waiting. Should the deployment be unreachable, the request is admitted (the budgets are a fairness
control; the providers' own limits still hold) and the failure is logged.

Without Serve (unit tests, one process) the budgets are an in-process
:class:`deployments.budgets.budget_deployment.LocalBudget`; :class:`TenantClient` speaks to either. The pure
accounting is :class:`cluster.policy.tenants.TenantBudgets`. The client also remembers
(:class:`cluster.policy.tenants.KnownOut`) a tenant whose requests per minute are spent until a
known time: its next requests are refused by :meth:`TenantClient.refusal` before they are parsed,
tokenized or sent to the deployment (a runaway loop's 429s cost the gateway almost nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from cluster.config import TenantConfig
from cluster.policy.rate_budget import Refusal
from cluster.policy.tenants import KnownOut, TenantBudgets, TenantReservation, over_budget

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle
from cluster.wire.errors import RateLimited
from deployments.budgets.budget_deployment import Budget, LocalBudget, ServeBudget

log = logging.getLogger("ray.serve")
Reserved = TenantReservation | RateLimited | None


class TenantClient:
    """The tenants' budgets as the gateway asks them: a reservation, a 429, or None (no budget)."""

    def __init__(self, budget: Budget, budgeted: set[str]) -> None:
        self._b = budget
        self._budgeted = budgeted
        self._pending: set[asyncio.Task[None]] = set()
        self.out = KnownOut()

    def refusal(self, tenant: str | None) -> RateLimited | None:
        return self.out.refusal(tenant, time.monotonic())

    async def reserve(self, tenant: str | None, input_tokens: int, max_tokens: int) -> Reserved:
        if tenant is None or tenant not in self._budgeted:
            return None
        try:
            got = await self._b.reserve(tenant, input_tokens, max_tokens)
        except Exception as exc:  # unreachable: admit, as without budgets
            log.warning("tenant budgets unreachable, admitting tenant %r unbudgeted: %r", tenant[:64], exc)
            return None
        if isinstance(got, Refusal):
            refused = over_budget(tenant, got)
            self.out.note(tenant, refused, time.monotonic())
            return refused
        return got

    def settle(self, res: TenantReservation, actual_tokens: int) -> None:
        self._send(self._b.settle(res, actual_tokens))

    def cancel(self, res: TenantReservation) -> None:
        self._send(self._b.cancel(res))

    def _send(self, call: Awaitable[None]) -> None:
        async def wait() -> None:
            try:
                await call
            except Exception as exc:
                log.warning("tenant budget settlement lost: %r", exc)

        task = asyncio.get_running_loop().create_task(wait())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


def tenant_budgets(tenants: list[TenantConfig], handle: DeploymentHandle | None) -> TenantClient:
    """The app's shared budgets when the app has the deployment, else this process's own."""
    budgeted = {t.name for t in tenants if t.rpm is not None or t.tpm is not None}
    if handle is None:
        return TenantClient(LocalBudget(TenantBudgets(tenants, time.monotonic())), budgeted)
    return TenantClient(ServeBudget("tenant budgets", handle), budgeted)
