"""Ray Serve LLM with its PrefixCacheAffinityRouter on vLLM-CPU: the peer of
:mod:`loadtest.benchmarks.bench_affinity_vllm`, run in a child process as ``../shared/notes/peers.md`` says.

    python -m loadtest.common.ray_llm_peer --config CFG.yaml --port P --metrics-port M --ready-file F

The child starts its own Ray (metrics exported on ``M``) and Serve on ``P``, deploys
``ray.serve.llm.build_openai_app`` with one LLMConfig: the tiny local model, the vLLM engine
arguments our backend gets from ``CFG`` (block size, KV cache bytes, batch limits, prefix
caching, eager mode), 2 replicas, the PrefixCacheAffinityRouter with its defaults. It writes "ok"
to the ready file when the app answers, then waits until its stdin closes and shuts Serve and Ray
down. :class:`RayLLMPeer` is the parent's handle; the engines' prefix-cache counters are read from
Ray's metrics endpoint (``ray_vllm_prefix_cache_{queries,hits}_total``, one series per replica).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.common.overhead_cluster import OursCluster
from loadtest.common.procs import LegFailed

HOST = "127.0.0.1"
ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"


def llm_config(cfg: Any) -> Any:
    """The LLMConfig for the config's vLLM backend (its engine arguments, its replicas)."""
    from ray.serve.llm import LLMConfig
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter  # noqa: F401  (importable)

    from cluster.tokens import resolve_model_path
    from deployments.launcher.local import ENGINE_ENV

    b = next(x for x in cfg.backends if x.kind == "vllm")
    m = cfg.model(b.model)
    e = b.engine
    engine = {
        "enable_prefix_caching": e.enable_prefix_caching,
        "enforce_eager": e.enforce_eager,
        "block_size": e.block_size,
        "kv_cache_memory_bytes": e.kv_cache_memory_bytes,
        "max_num_seqs": e.max_num_seqs,
        "max_model_len": e.max_model_len or m.context_window,
        "max_num_batched_tokens": e.max_num_batched_tokens,
    }
    env = {k: v for k, v in {**ENGINE_ENV, **b.env}.items() if not k.startswith("RAY_")}
    return LLMConfig(
        model_loading_config={"model_id": m.name, "model_source": resolve_model_path(m.path or m.name)},
        accelerator_config={"kind": "cpu"},
        engine_kwargs={k: v for k, v in engine.items() if v is not None},
        deployment_config={
            "num_replicas": b.replicas,
            "ray_actor_options": {"num_cpus": 0.5},
            "request_router_config": {"request_router_class": ROUTER},
        },
        log_engine_metrics=True,
        runtime_env={"env_vars": env},
    )


def serve_peer(config_path: Path, port: int, metrics_port: int, ready_file: Path) -> int:
    """The child: Ray + Serve + the app, until stdin closes."""
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from cluster.config import load_config
    from deployments.launcher.local import scratch_env

    os.environ.update({k: v for k, v in scratch_env().items() if k.startswith("RAY_AUTH")})
    cfg = load_config(config_path)
    try:
        # Logical CPUs: each LLMServer replica reserves a 1.5-CPU bundle and the ingress one more; the
        # two cores here are shared by everything anyway (as our cluster's replicas share them).
        ray.init(num_cpus=8, _metrics_export_port=metrics_port, include_dashboard=False)
        serve.start(http_options={"host": HOST, "port": port})
        app = build_openai_app({"llm_configs": [llm_config(cfg)]})
        serve.run(app, name="ray-llm-peer", route_prefix="/", blocking=False)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            raise RuntimeError("the Ray Serve LLM app never answered /v1/models")
        ready_file.write_text("ok")
    except Exception as exc:  # the parent reads why
        ready_file.write_text(f"failed: {type(exc).__name__}: {exc}")
        raise
    sys.stdin.read()  # the parent closes it to stop us
    serve.shutdown()
    ray.shutdown()
    return 0


class RayLLMPeer(OursCluster):
    """The parent's handle: the child above, stopped the way our cluster's child is (stdin closed,
    then the port must be free and nothing of it left running)."""

    def __init__(self, name: str, cfg: Any, port: int, logdir: Path) -> None:
        from deployments.launcher.local import free_port

        self.metrics_port = free_port()
        super().__init__(name, cfg, port, logdir)

    def command(self, config_path: Path) -> list[str]:
        cmd = [sys.executable, "-m", "loadtest.common.ray_llm_peer", "--config", str(config_path)]
        cmd += ["--port", str(self.port), "--metrics-port", str(self.metrics_port)]
        return [*cmd, "--ready-file", str(self.ready_file)]

    def counters(self) -> dict[str, tuple[int, int]]:
        """replica -> (queries, hits) from Ray's metrics endpoint (exported in batches: read settled)."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError as exc:
            raise LegFailed(f"{self.name}: Ray's metrics endpoint: {exc}") from exc
        out: dict[str, list[float]] = {}
        for kind, labels, value in _SERIES.findall(text):
            replica = _REPLICA.search(labels)
            key = replica.group(1) if replica else labels
            out.setdefault(key, [0.0, 0.0])[0 if kind == "queries" else 1] += float(value)
        return {k: (int(q), int(h)) for k, (q, h) in out.items()}


_SERIES = re.compile(r"^ray_vllm_prefix_cache_(queries|hits)_total\{([^}]*)\}\s+([0-9.eE+]+)$", re.M)
_REPLICA = re.compile(r'ReplicaId="([^"]+)"')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--ready-file", required=True)
    a = ap.parse_args(argv)
    return serve_peer(Path(a.config), a.port, a.metrics_port, Path(a.ready_file))


if __name__ == "__main__":
    raise SystemExit(main())
