"""The Serve application builder: one :class:`ClusterConfig` in, the whole graph out.

``serve run deployments.app:build_app config_path=configs/local.yaml`` locally; KubeRay's
``serveConfigV2`` passes the config inline as ``args.config``. Serve hands the builder the args
as a plain dict (from a config file or the CLI's ``key=value`` pairs): they are validated here
into :class:`AppArgs`, and a bad one fails the deploy with a message naming the field.

Deployments: ``Gateway`` (the app's ingress, serving HTTP itself behind HAProxy),
``backend-<name>`` per self-hosted engine backend, ``budget-<name>`` per provider backend
with an RPM / TPM / in-flight limit (its shared budget), and ``indexer-<name>-<shard>`` per
shard of a backend whose KV events indexers apply (``affinity.kv_index: indexer``). Provider
adapters run inside the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import cast

from pydantic import Field, ValidationError, model_validator
from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from cluster.base import Strict
from cluster.config import BackendConfig, ClusterConfig, load_config
from cluster.config_checks import config_warnings
from cluster.dataplane import (
    GATEWAY_ENV,
    GATEWAY_LOGGING,
    SERVE_ENV,
    budget_deployment,
    deployment_options,
    indexer_deployments,
    tenant_budget_deployment,
)
from deployments.budgets.budget_deployment import BudgetDeployment
from deployments.engine.engine import EngineReplica
from deployments.gateway.gateway import Gateway
from deployments.indexer.indexer import KVIndexer

__all__ = ["SERVE_ENV", "AppArgs", "build_app", "build_graph", "engine_options"]
log = logging.getLogger(__name__)


class AppArgs(Strict):
    config: ClusterConfig | None = Field(None, description="The whole cluster config, inline.")
    config_path: str | None = Field(None, description="Or a path to a YAML config.")

    @model_validator(mode="after")
    def _one(self) -> AppArgs:
        if (self.config is None) == (self.config_path is None):
            raise ValueError("give exactly one of 'config' and 'config_path'")
        return self

    def resolve(self) -> ClusterConfig:
        return self.config if self.config is not None else load_config(self.config_path or "")


def _served(cls: type) -> Deployment:
    """The Serve ``Deployment`` that ``@serve.deployment`` made of ``cls``: mypy sees the class, as
    Ray's types are skipped (pyproject's mypy overrides)."""
    return cast(Deployment, cls)


def engine_options(b: BackendConfig) -> dict[str, object]:
    """Serve options of one engine backend's deployment (the k8s generator writes the same)."""
    opts = deployment_options(b)
    opts["request_router_config"] = RequestRouterConfig(**opts["request_router_config"])
    return opts


def build_graph(cfg: ClusterConfig) -> Application:
    for warning in config_warnings(cfg):  # loads, but probably not as meant (cluster check says it too)
        log.warning("config %s: %s", cfg.name, warning)
    engines, budgets = {}, {}
    for b in cfg.backends:
        if not b.kind.caps.engine_replicas:
            name = budget_deployment(b)
            if name is not None:  # a limited provider: one budget for every gateway replica
                assert b.provider is not None
                budgets[b.name] = (
                    _served(BudgetDeployment)
                    .options(name=name)
                    .bind(provider=b.provider.model_dump(mode="json"))
                )
            continue
        model = cfg.model(b.model)
        assert model is not None  # validated
        engines[b.name] = (
            _served(EngineReplica)
            .options(**engine_options(b))
            .bind(
                b.model_dump(mode="json"),
                model.model_dump(mode="json"),
                cfg.tracing.model_dump(mode="json"),
                cfg.server.gc_freeze,
            )
        )
    indexers = {b.name: _indexers(b, engines[b.name]) for b in cfg.backends if indexer_deployments(b)}
    return (
        _served(Gateway)
        .options(**gateway_options(cfg))
        .bind(cfg.model_dump(mode="json"), engines, budgets, _tenant_budgets(cfg), indexers)
    )


def _indexers(b: BackendConfig, engines: Application) -> list[Application]:
    """A backend's KV indexers (``affinity.kv_index: indexer``), one per shard: one replica each."""
    names = indexer_deployments(b)
    return [
        _served(KVIndexer)
        .options(name=name, num_replicas=1, ray_actor_options={"num_cpus": 0})
        .bind(b.model_dump(mode="json"), engines, shard, len(names))
        for shard, name in enumerate(names)
    ]


def gateway_options(cfg: ClusterConfig) -> dict[str, object]:
    """Serve options of the gateway deployment (also given to the overhead benchmark's floor relay,
    ``loadtest/common/serve_floor.py``, which must be served exactly as the gateway is)."""
    actor = {"num_cpus": 0.1, "runtime_env": {"env_vars": GATEWAY_ENV}}
    return {
        "num_replicas": cfg.server.gateway_replicas,
        "ray_actor_options": actor,
        "logging_config": GATEWAY_LOGGING,
    }


def _tenant_budgets(cfg: ClusterConfig) -> Application | None:
    """The tenants' shared budgets (one replica every gateway asks), when a tenant has one."""
    name = tenant_budget_deployment(cfg)
    if name is None:
        return None
    return (
        _served(BudgetDeployment)
        .options(name=name)
        .bind(tenants=[t.model_dump(mode="json") for t in cfg.tenants])
    )


def build_app(args: Mapping[str, object] | AppArgs) -> Application:
    """Serve's entry point: ``args`` as Serve passes them (a dict, or our model)."""
    try:
        parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(dict(args))
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "args"
        raise ValueError(f"deployments.app:build_app: invalid args at '{loc}': {first['msg']}") from exc
    return build_graph(parsed.resolve())
