"""Start and stop the cluster on this machine: a local Ray, Serve on a loopback port, the app.

Used by ``cluster serve``, the quick start and the integration tests, so all three run the same
way. Scratch files (vLLM's sockets and caches, Ray's auth token) go under one folder.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig, load_config
from cluster.tiny_model import cache_root

# vLLM's CPU build on small shared machines (see shared notes): in-process engine, one OpenMP
# thread per engine, no pinning, offline.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


def scratch_env(root: Path | None = None) -> dict[str, str]:
    root = root or cache_root() / "scratch"
    env = dict(ENGINE_ENV)
    for name, sub in (
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("HF_HOME", "hf"),
        ("LLMC_CACHE", ""),
    ):
        env[name] = str(root / sub) if sub else str(cache_root())
    for p in (root, root / "vllm", root / "inductor", root / "hf"):
        p.mkdir(parents=True, exist_ok=True)
    # Ray 2.60 turns token auth on; keep its token in our scratch folder, not the home folder.
    token = root / "ray_auth_token"
    if not token.exists() or not token.read_text().strip():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    return env


def start(
    config: ClusterConfig | str | os.PathLike[str],
    *,
    port: int | None = None,
    num_cpus: int = 16,
    metrics_port: int | None = None,
    route_prefix: str = "/",
    blocking_timeout_s: float = 300.0,
) -> ClusterConfig:
    """Start Ray + Serve and deploy the app; returns once every deployment is healthy."""
    import ray
    from ray import serve

    from deployments.app import build_graph

    cfg = config if isinstance(config, ClusterConfig) else load_config(config)
    if port is not None:
        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"port": port})})
    env = scratch_env()
    os.environ.update(env)  # the driver's own children (Ray's raylet, workers) inherit it
    init_kwargs: dict[str, Any] = {
        "num_cpus": num_cpus,  # bookkeeping only: Ray must be able to place every deployment
        "include_dashboard": False,
        "runtime_env": {"env_vars": env},
        "log_to_driver": os.environ.get("LLMC_RAY_LOGS", "0") == "1",
    }
    if metrics_port is not None:
        init_kwargs["_metrics_export_port"] = metrics_port
    if not ray.is_initialized():
        ray.init(**init_kwargs)
    serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
    deadline = time.monotonic() + blocking_timeout_s
    serve.run(build_graph(cfg), name=cfg.name, route_prefix=route_prefix, blocking=False)
    _wait_running(cfg.name, deadline)
    return cfg


def _wait_running(app: str, deadline: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            return
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"application {app} failed to deploy: {status.message}")
        time.sleep(0.5)
    raise TimeoutError(f"application {app} not running after the deadline")


def replica_stats(app_name: str) -> dict[str, Any]:
    """What each backend replica of an app last posted to its stats hub (replica id → stats)."""
    import ray

    from deployments.stats_hub import HUB_NAME

    hub = ray.get_actor(f"{HUB_NAME}-{app_name}", namespace="serve")
    return ray.get(hub.snapshot.remote())


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
