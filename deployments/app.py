"""The Serve application builder: one :class:`ClusterConfig` in, the whole graph out.

``serve run deployments.app:build_app config_path=configs/local.yaml`` locally; KubeRay's
``serveConfigV2`` passes the config inline as ``args.config`` (see ``cluster k8s render``).
Deployment names: ``Ingress``, ``Router`` and ``backend-<name>`` per backend.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import BackendConfig, ClusterConfig, load_config
from deployments.backend_replica import BackendReplica
from deployments.ingress import Ingress
from deployments.router import Router

REQUEST_ROUTER = "deployments.request_router:ClusterRequestRouter"
RAY_PREFIX_ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: ClusterConfig | None = Field(None, description="The whole cluster config, inline.")
    config_path: str | None = Field(None, description="Or a path to a YAML config.")

    @model_validator(mode="after")
    def _one(self) -> AppArgs:
        if (self.config is None) == (self.config_path is None):
            raise ValueError("give exactly one of 'config' and 'config_path'")
        return self

    def resolve(self) -> ClusterConfig:
        return self.config if self.config is not None else load_config(self.config_path or "")


def backend_options(b: BackendConfig) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": b.resources.num_cpus, "num_gpus": b.resources.num_gpus}
    if b.resources.memory_bytes:
        actor["memory"] = b.resources.memory_bytes
    # b.env is applied by the replica itself at start: Ray's runtime_env agent logs env_vars in full.
    opts: dict[str, Any] = {"name": f"backend-{b.name}", "ray_actor_options": actor}
    if b.routing == "ray_prefix":
        opts["request_router_config"] = RequestRouterConfig(request_router_class=RAY_PREFIX_ROUTER)
    elif b.routing != "power_of_two":  # power_of_two: Serve's default router
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=REQUEST_ROUTER, request_router_kwargs={"mode": b.routing}
        )
    if b.autoscaling is not None:
        target = b.autoscaling.target_ongoing_requests
        if target is None:
            # Keep the engine's batch about 3/4 full before adding a replica.
            target = max(1.0, math.floor(0.75 * (b.engine.max_num_seqs or 256)))
        opts["autoscaling_config"] = {
            "min_replicas": b.autoscaling.min_replicas,
            "max_replicas": b.autoscaling.max_replicas,
            "target_ongoing_requests": target,
        }
    else:
        opts["num_replicas"] = b.replicas
    return opts


def build_graph(cfg: ClusterConfig) -> Application:
    dump = cfg.model_dump(mode="json")
    handles = {}
    for b in cfg.backends:
        model = cfg.model(b.model)
        assert model is not None  # validated
        handles[b.name] = BackendReplica.options(**backend_options(b)).bind(
            b.model_dump(mode="json"), model.model_dump(mode="json"), cfg.name
        )
    router = Router.options(
        num_replicas=cfg.server.router_replicas, ray_actor_options={"num_cpus": 0.1}
    ).bind(dump, handles)
    return Ingress.options(
        num_replicas=cfg.server.ingress_replicas, ray_actor_options={"num_cpus": 0.1}
    ).bind(dump, router)


def build_app(args: AppArgs) -> Application:
    return build_graph(args.resolve())
