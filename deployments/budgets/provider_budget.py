"""A provider backend's RPM / TPM / in-flight budget: where it lives, one place per backend whatever
the replicas.

In a Serve app the budget is the app's shared-budget deployment for the backend
(``budget-<backend>``, :class:`deployments.budgets.budget_deployment.BudgetDeployment`), so every gateway
replica draws from one budget, as the provider counts it; two apps with a backend of the same name
have one budget each. Without Serve (unit and adapter tests, a single process) it is an in-process
:class:`deployments.budgets.budget_deployment.LocalBudget`, one per backend per process. A backend with no
limit has no shared state at all. All speak :class:`deployments.budgets.budget_deployment.Budget`:
``reserve`` (optionally waiting a bounded time for room), ``settle`` with the tokens the provider
reported (or the adapter's estimate when it reported none), ``cancel``.

The pure accounting is :class:`cluster.providers.budget.ProviderBudget`; what a request cost is
computed by the adapter (:func:`cluster.cost.cost_usd`), not by the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.config import BackendConfig, ProviderConfig
from cluster.dataplane import budget_deployment
from cluster.json_types import JSONObject
from cluster.policy.rate_budget import Reservation
from cluster.providers.budget import ProviderBudget
from deployments.budgets.budget_deployment import Budget, LocalBudget, Reserved, ServeBudget

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

__all__ = ["Budget", "LocalBudget", "UnlimitedBudget", "get_budget", "local_budget"]


class UnlimitedBudget:
    """A provider with no RPM, TPM or in-flight limit: nothing to count across replicas, so no actor
    and no call per request."""

    async def reserve(self, key: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0) -> Reserved:
        return Reservation(key, input_tokens + max_tokens)

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        return None

    async def cancel(self, reservation: Reservation) -> None:
        return None

    def snapshot(self) -> JSONObject:
        return {"unlimited": True}

    def snapshot_now(self) -> JSONObject:
        return self.snapshot()


_LOCAL: dict[str, LocalBudget] = {}


def local_budget(backend: str, cfg: ProviderConfig, *, window_s: float = 60.0) -> LocalBudget:
    """This process's budget for ``backend`` (shared by every adapter instance in the process)."""
    b = _LOCAL.get(backend)
    if b is None:
        b = _LOCAL[backend] = LocalBudget(ProviderBudget.from_config(cfg, window_s=window_s))
    elif isinstance(b.limiter, ProviderBudget):
        b.limiter.configure(cfg)
        b.changed()
    return b


def get_budget(backend: BackendConfig, handle: DeploymentHandle | None = None) -> Budget:
    """The app's budget deployment through ``handle`` (every gateway replica shares it), else the
    in-process one (a single process: unit and adapter tests); nothing for a backend with no limit."""
    if backend.provider is None:
        raise ValueError(f"backend '{backend.name}' has no provider section")
    p = backend.provider
    if budget_deployment(backend) is None:  # no limit: nothing to share
        return UnlimitedBudget()
    if handle is not None:
        return ServeBudget(f"provider backend '{backend.name}'", handle, backend=backend.name)
    return local_budget(backend.name, p)
