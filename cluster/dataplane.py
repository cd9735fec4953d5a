"""What the data plane needs in every Ray process of a cluster, as environment variables (the
local launcher and the RayService manifests set them; Serve reads them at import):

* each gateway replica serves HTTP itself (direct ingress) behind Ray Serve's HAProxy;
* Serve's request router runs on the gateway's own event loop (the gateway calls it per request,
  and the routing payload it hands over is a live object of the gateway's);
* engine replicas report their own ongoing requests for autoscaling (no request reaches them
  through a Serve handle, so the handles have nothing to count).
"""

from __future__ import annotations

from cluster.config import BackendConfig, ClusterConfig

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE": "0",
}
INTERNAL_TOKEN_ENV = "LLMC_INTERNAL_TOKEN"

# The engine deployments' Serve options that carry the data plane (the app builder and the k8s
# generator both write them): the shim request router that lets the gateway's routing view
# decide, how often replicas publish their endpoint and load to it, how often they report their
# ongoing requests for autoscaling.
SHIM_ROUTER = "deployments.request_router:ShimRequestRouter"
ROUTING_STATS_PERIOD_S = 0.5
AUTOSCALING_METRICS_INTERVAL_S = 1.0

# The gateway's own process only: its code on the replica's main event loop, beside the HTTP
# server that feeds it, instead of a thread of its own (a thread hop per request and per chunk
# sent otherwise). The gateway never blocks its loop (big bodies are prepared in a thread).
# Engines keep Serve's default: a vLLM engine's calls must not stall Serve's control traffic.
GATEWAY_ENV: dict[str, str] = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def budget_deployment(b: BackendConfig) -> str | None:
    """The name of the Serve deployment that holds a provider backend's RPM / TPM / in-flight budget
    (one replica, in the app: every gateway replica draws from it, and it goes with the app), or
    None when the backend has no such limit (nothing to share)."""
    p = b.provider
    if p is None or (p.rpm is None and p.tpm is None and p.max_in_flight is None):
        return None
    return f"budget-{b.name}"


TENANT_BUDGETS = "tenant-budgets"


def tenant_budget_deployment(cfg: ClusterConfig) -> str | None:
    """The Serve deployment that holds the tenants' request and token budgets for its app (one
    replica; every gateway replica asks it), or None when no tenant has a budget."""
    if any(t.rpm is not None or t.tpm is not None for t in cfg.tenants):
        return TENANT_BUDGETS
    return None
