"""What the data plane needs in every Ray process of a cluster, as environment variables (the
local launcher and the RayService manifests set them; Serve reads them at import):

* each gateway replica serves HTTP itself (direct ingress) behind Ray Serve's HAProxy;
* Serve's request router runs on the gateway's own event loop (the gateway calls it per request,
  and the routing payload it hands over is a live object of the gateway's);
* engine replicas report their own ongoing requests for autoscaling (no request reaches them
  through a Serve handle, so the handles have nothing to count).
"""

from __future__ import annotations

import math

from cluster.config import BackendConfig, ClusterConfig
from cluster.json_types import JSONObject

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE": "0",
    # HAProxy's per-request metrics: one log line per request over a unix socket, parsed in Python
    # by Serve's HAProxyManager (~0.14 ms of CPU per request there, plus HAProxy's formatting; the
    # relay benchmark's throughput rose ~20 % without it). The gateway counts every request itself
    # (llmc_* metrics), so Serve's serve_num_http_* families from HAProxy are not needed.
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
}
INTERNAL_TOKEN_ENV = "LLMC_INTERNAL_TOKEN"

# The engine deployments' Serve options that carry the data plane (the app builder and the k8s
# generator both write them): the shim request router that lets the gateway's routing view
# decide, how often replicas publish their endpoint and load to it, how often they report their
# ongoing requests for autoscaling.
SHIM_ROUTER = "deployments.gateway.request_router:ShimRequestRouter"
ROUTING_STATS_PERIOD_S = 0.5
AUTOSCALING_METRICS_INTERVAL_S = 1.0

# The gateway's own process only: its code on the replica's main event loop, beside the HTTP
# server that feeds it, instead of a thread of its own (a thread hop per request and per chunk
# sent otherwise). The gateway never blocks its loop (big bodies are prepared in a thread).
# Engines keep Serve's default: a vLLM engine's calls must not stall Serve's control traffic.
# And the middleware Serve runs around the gateway's direct ingress before it reads a request's
# headers (deployments/gateway/header_guard.py: a 400 for a header Serve would fail on or echo whole).
GATEWAY_ENV: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.gateway.header_guard:middlewares",
}


# The gateway's Serve logging: no access line per request (it was 3 % of the gateway's CPU on the
# relay benchmark; the gateway's own metrics count every request), and nothing under WARNING (Serve
# still formats and hands an access record to the logger for each request; at INFO its handlers ran
# for each one too). The gateway's own warnings and errors still log.
GATEWAY_LOGGING: JSONObject = {"enable_access_log": False, "log_level": "WARNING"}


def budget_deployment(b: BackendConfig) -> str | None:
    """The name of the Serve deployment that holds a provider backend's RPM / TPM / in-flight budget
    (one replica, in the app: every gateway replica draws from it, and it goes with the app), or
    None when the backend has no such limit (nothing to share)."""
    p = b.provider
    if p is None or (p.rpm is None and p.tpm is None and p.max_in_flight is None):
        return None
    return f"budget-{b.name}"


def target_ongoing_requests(b: BackendConfig) -> float:
    """The autoscaling target: the config's, else 3/4 of the engine batch (keep the batch about
    3/4 full before adding a replica)."""
    assert b.autoscaling is not None
    if b.autoscaling.target_ongoing_requests is not None:
        return b.autoscaling.target_ongoing_requests
    return max(1.0, math.floor(0.75 * (b.engine.max_num_seqs or 256)))


def deployment_options(b: BackendConfig) -> JSONObject:
    """Serve options of one engine backend's deployment, as plain data: the app builder passes them
    to ``.options()`` and the k8s generator writes them into ``serveConfigV2``."""
    actor: JSONObject = {"num_cpus": b.resources.num_cpus, "num_gpus": b.resources.num_gpus}
    if b.resources.memory_bytes:
        actor["memory"] = b.resources.memory_bytes
    # b.env is applied by the replica itself at start: Ray's runtime_env agent logs env_vars in full.
    opts: JSONObject = {
        "name": f"backend-{b.name}",
        "request_router_config": {
            "request_router_class": SHIM_ROUTER,
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        },
    }
    if b.autoscaling is None:
        opts["num_replicas"] = b.replicas
    else:
        opts["autoscaling_config"] = {
            "min_replicas": b.autoscaling.min_replicas,
            "max_replicas": b.autoscaling.max_replicas,
            "target_ongoing_requests": target_ongoing_requests(b),
            "metrics_interval_s": AUTOSCALING_METRICS_INTERVAL_S,
        }
    opts["ray_actor_options"] = actor
    return opts


TENANT_BUDGETS = "tenant-budgets"


def indexer_deployments(b: BackendConfig) -> list[str]:
    """The Serve deployments of a backend's KV indexers (``affinity.kv_index: indexer``: one per
    shard, one replica each; :mod:`deployments.indexer.indexer`), none when its gateways apply the
    engines' events themselves."""
    a = b.affinity
    if not b.kind.caps.engine_replicas or b.routing != "cache_aware" or a.kv_index != "indexer":
        return []
    return [f"indexer-{b.name}-{s}" for s in range(a.indexer_shards)]


def tenant_budget_deployment(cfg: ClusterConfig) -> str | None:
    """The Serve deployment that holds the tenants' request and token budgets for its app (one
    replica; every gateway replica asks it), or None when no tenant has a budget."""
    if any(t.rpm is not None or t.tpm is not None for t in cfg.tenants):
        return TENANT_BUDGETS
    return None
