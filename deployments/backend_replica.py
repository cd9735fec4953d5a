"""One Serve deployment class for every kind of backend: a vLLM engine, the simulated engine or a
provider adapter. The replica builds its backend from the config and streams its chunks; a
background task posts the backend's stats snapshot to the stats hub a few times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cluster.backend import Backend
from cluster.config import BackendConfig, ModelConfig
from cluster.protocol import BackendStats, Chunk, GenerateRequest
from deployments.stats_hub import get_hub

log = logging.getLogger("ray.serve")

STATS_PERIOD_S = 0.2


def build_backend(backend: BackendConfig, model: ModelConfig, replica: str) -> Backend:
    if backend.kind == "vllm":
        from deployments.vllm_replica import VLLMBackend

        return VLLMBackend(backend, model, replica)
    if backend.kind == "sim":
        from cluster.sim_backend import SimBackend

        return SimBackend.from_config(backend, model, replica)
    from deployments.providers import build_provider_backend

    return build_provider_backend(backend, model, replica)


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=2, health_check_timeout_s=30)
class BackendReplica:
    def __init__(self, backend: dict[str, Any], model: dict[str, Any], app_name: str) -> None:
        self.cfg = BackendConfig.model_validate(backend)
        # Set here rather than through Ray's runtime_env, whose agent logs env_vars in full; before
        # the backend is built, so that engine settings (OMP_NUM_THREADS …) take effect.
        os.environ.update(self.cfg.env)
        model_cfg = ModelConfig.model_validate(model)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.backend = build_backend(self.cfg, model_cfg, self.replica_id)
        self._hub = get_hub(app_name)
        self._reporter = asyncio.get_event_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the hub restarting must not kill the replica
                await self._hub.report.remote(self.backend.stats())
            await asyncio.sleep(STATS_PERIOD_S)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        async for chunk in self.backend.generate(req):
            yield chunk

    def stats(self) -> BackendStats:
        return self.backend.stats()

    def check_health(self) -> None:
        if not self.backend.stats().healthy:
            raise RuntimeError(f"backend {self.cfg.name} replica {self.replica_id} reports unhealthy")

    def __del__(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None) if hasattr(self, "backend") else None
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()
