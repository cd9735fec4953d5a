"""The Serve deployment that holds one provider backend's budget for its app (``budget-<backend>``).

One replica: the budget is one count, as the provider keeps it. Waits for room happen inside it
(``reserve`` with ``wait_s``), so it takes many requests at once; it uses no CPU reservation (it
only counts). If it dies Serve starts a new one with an empty window (the provider's own 429s,
which fail over like any other, cover the gap).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from cluster.config import ProviderConfig
from cluster.providers.budget import Admission
from cluster.wire.protocol import Usage
from deployments.provider_budget import LocalBudget


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class ProviderBudgetDeployment:
    def __init__(self, provider: dict[str, Any], window_s: float = 60.0) -> None:
        self._local = LocalBudget.from_config(ProviderConfig.model_validate(provider), window_s=window_s)

    async def reserve(
        self, request_id: str, input_tokens: int, max_tokens: int, wait_s: float = 0.0
    ) -> Admission:
        return await self._local.reserve(request_id, input_tokens, max_tokens, wait_s)

    async def settle(self, request_id: str, usage: Usage) -> float:
        return await self._local.settle(request_id, usage)

    async def release(self, request_id: str, tokens_used: int = 0) -> None:
        await self._local.release(request_id, tokens_used)

    async def snapshot(self) -> dict[str, Any]:
        return self._local.snapshot()
