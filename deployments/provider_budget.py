"""Where a provider's RPM / TPM / in-flight budget lives: one place per backend, whatever the replicas.

In a Serve app the budget is a deployment of the app (``budget-<backend>``, one replica), so every
gateway replica draws from one budget, as the provider counts it; it is deployed, redeployed and
deleted with its app, and two apps with a backend of the same name have one budget each.
Without Serve (unit and adapter tests, a single process) it is an in-process object, one per
backend per process. A backend with no limit has no shared state at all. All speak the same async
interface: ``reserve`` (optionally waiting a bounded time for room), ``settle`` with the
provider's usage, ``release`` without it.

The pure accounting is :class:`cluster.providers.budget.ProviderBudget`; this module only adds
the clock, the waiting and the place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from cluster.config import BackendConfig, ProviderConfig
from cluster.cost import Prices, cost_usd
from cluster.dataplane import budget_deployment
from cluster.providers.budget import Admission, ProviderBudget
from cluster.wire.errors import BackendUnavailable
from cluster.wire.protocol import Usage

log = logging.getLogger(__name__)


class Budget(Protocol):
    async def reserve(
        self, request_id: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0
    ) -> Admission: ...

    async def settle(self, request_id: str, usage: Usage) -> float: ...

    async def release(self, request_id: str, tokens_used: int = 0) -> None: ...


class LocalBudget:
    """The budget in this process. Waiters wake when a request ends or when the window frees room."""

    def __init__(self, budget: ProviderBudget, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self._clock = clock
        self._changed: asyncio.Event | None = None
        self.waiting = 0

    @classmethod
    def from_config(cls, cfg: ProviderConfig, *, window_s: float = 60.0) -> LocalBudget:
        return cls(ProviderBudget.from_config(cfg, window_s=window_s))

    async def reserve(
        self, request_id: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0
    ) -> Admission:
        give_up = self._clock() + max(0.0, wait_s)
        while True:
            adm = self.budget.try_reserve(request_id, input_tokens, max_tokens, self._clock())
            remaining = give_up - self._clock()
            if adm.ok or adm.retry_after_s is None or remaining <= 0:
                return adm
            changed = self._event()
            self.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(remaining, max(adm.retry_after_s, 0.001)))
            except TimeoutError:
                pass
            finally:
                self.waiting -= 1

    async def settle(self, request_id: str, usage: Usage) -> float:
        cost = self.budget.settle(request_id, usage, self._clock())
        self._wake()
        return cost

    async def release(self, request_id: str, tokens_used: int = 0) -> None:
        self.budget.release(request_id, self._clock(), tokens_used)
        self._wake()

    def configure(self, cfg: ProviderConfig) -> None:
        b = self.budget
        b.rpm, b.tpm, b.max_in_flight = cfg.rpm, cfg.tpm, cfg.max_in_flight
        b.prices = Prices.from_config(cfg)
        self._wake()

    def snapshot(self) -> dict[str, Any]:
        return {**self.budget.snapshot(self._clock()), "waiting": self.waiting}

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _wake(self) -> None:
        # One event per generation: everyone waiting now retries; later waiters get a fresh one.
        if self._changed is not None:
            self._changed.set()
            self._changed = None


class ServeBudget:
    """The backend's budget deployment in this app (``budget-<backend>``, see
    ``deployments/budget_deployment.py``), through a Serve handle: one call per reserve, settle or
    release, never per chunk. A budget replica that is gone is a clean 503 for the request."""

    def __init__(self, backend: str, handle: Any) -> None:
        self.backend = backend
        self._handle = handle

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayError

        try:
            return await getattr(self._handle, method).remote(*args)
        except RayError as exc:  # died or restarting: Serve brings a new one up
            raise BackendUnavailable(
                f"provider backend '{self.backend}': its budget is unavailable ({type(exc).__name__})",
                backend=self.backend,
            ) from exc

    async def reserve(
        self, request_id: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0
    ) -> Admission:
        return await self._call("reserve", request_id, input_tokens, max_tokens, wait_s)

    async def settle(self, request_id: str, usage: Usage) -> float:
        return await self._call("settle", request_id, usage)

    async def release(self, request_id: str, tokens_used: int = 0) -> None:
        await self._call("release", request_id, tokens_used)

    async def snapshot(self) -> dict[str, Any]:
        return await self._call("snapshot")


class UnlimitedBudget:
    """A provider with no RPM, TPM or in-flight limit: nothing to count across replicas, so no actor
    and no call per request; only the cost is computed, here."""

    def __init__(self, cfg: ProviderConfig) -> None:
        self.prices = Prices.from_config(cfg)

    async def reserve(
        self, request_id: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0
    ) -> Admission:
        return Admission(True, reserved_tokens=input_tokens + max_tokens)

    async def settle(self, request_id: str, usage: Usage) -> float:
        return cost_usd(usage, self.prices)

    async def release(self, request_id: str, tokens_used: int = 0) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {"unlimited": True}


_LOCAL: dict[str, LocalBudget] = {}


def local_budget(backend: str, cfg: ProviderConfig, *, window_s: float = 60.0) -> LocalBudget:
    """This process's budget for ``backend`` (shared by every adapter instance in the process)."""
    b = _LOCAL.get(backend)
    if b is None:
        b = _LOCAL[backend] = LocalBudget.from_config(cfg, window_s=window_s)
    else:
        b.configure(cfg)
    return b


def get_budget(backend: BackendConfig, handle: Any = None) -> Budget:
    """The app's budget deployment through ``handle`` (every gateway replica shares it), else the
    in-process one (a single process: unit and adapter tests); nothing for a backend with no limit."""
    if backend.provider is None:
        raise ValueError(f"backend '{backend.name}' has no provider section")
    p = backend.provider
    if budget_deployment(backend) is None:  # no limit: nothing to share
        return UnlimitedBudget(p)
    if handle is not None:
        return ServeBudget(backend.name, handle)
    return local_budget(backend.name, p)
