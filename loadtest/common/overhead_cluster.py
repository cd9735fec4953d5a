"""Our cluster for the overhead benchmark (:mod:`loadtest.benchmarks.bench_overhead`): the provider config in
front of the fake upstream, and the cluster in a child process (``python -m loadtest.benchmarks.bench_overhead
--serve-cluster``) whose port must be free and whose processes must be gone after it stops."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ClusterConfig, load_config, parse_config
from loadtest.common.overhead_client import HOST, MODEL
from loadtest.common.overhead_stats import _r
from loadtest.common.procs import LegFailed, Proc, port_free

# --- our cluster, in a child process ---------------------------------------------------------------


def provider_config(upstream_port: int, port: int) -> ClusterConfig:
    """Our cluster for the relay phase: one OpenAI-wire provider backend in front of the fake upstream,
    admission limits high enough never to queue or shed at 64 streams, and no provider RPM/TPM or
    in-flight budget (a budget adds one call to its shared actor per request: measured apart)."""
    return parse_config(
        {
            "name": "llmc-bench-overhead",
            "server": {"host": HOST, "port": port, "default_surface": "chat"},
            "models": [
                {
                    "name": MODEL,
                    "tokenizer": "tiktoken:gpt-4o-mini",
                    "context_window": 8192,
                    "default_max_tokens": 64,
                }
            ],
            "backends": [
                {
                    "name": "fake-openai",
                    "kind": "provider",
                    "model": MODEL,
                    "replicas": 1,
                    "resources": {"num_cpus": 0.1},
                    "max_in_flight_per_replica": 1024,
                    "provider": {
                        "api": "openai",
                        "base_url": f"http://{HOST}:{upstream_port}/v1",
                        "first_token_timeout_s": 30,
                        "total_timeout_s": 120,
                    },
                }
            ],
            "surfaces": [
                {
                    "name": "chat",
                    "ttft_slo_ms": 1000,
                    "max_concurrency": 256,
                    "max_queue": 512,
                    "queue_deadline_ms": 10000,
                },
            ],
            "routes": [{"model": MODEL, "candidates": ["fake-openai"]}],
        },
        source="bench_overhead",
    )


def serve_cluster(config_path: Path, port: int, ready_file: Path, floor_upstream: str | None = None) -> int:
    """The child side of :class:`OursCluster`: start (and the ``floor`` app beside it when given its
    upstream: :mod:`loadtest.common.serve_floor`), say so in ``ready_file``, stop when stdin closes."""
    import traceback

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that local.stop() still runs
    try:
        from deployments.launcher import local

        cfg = local.start(load_config(config_path), port=port, metrics_port=0)
        if floor_upstream:
            from loadtest.common.serve_floor import deploy_floor

            deploy_floor(cfg, floor_upstream)
    except BaseException as exc:
        traceback.print_exc()
        ready_file.write_text(f"error: local.start failed: {type(exc).__name__}: {exc}"[:2000])
        with contextlib.suppress(BaseException):
            local.stop()
        return 1
    ready_file.write_text("ok")
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        local.stop()
    return 0


class OursCluster(Proc):
    """Our cluster in a child process (``local.start(cfg, port=...)`` there, ``local.stop()`` when its
    stdin closes); afterwards the port must be free and nothing of it left running (the shared
    notes: HAProxy can outlive a shutdown)."""

    settle_s = 10.0  # Ray's workers and actors exit a few seconds after ray.shutdown()

    def __init__(
        self, name: str, cfg: ClusterConfig, port: int, logdir: Path, floor_upstream: str | None = None
    ) -> None:
        self.port = port
        self.floor_upstream = floor_upstream  # also serve loadtest.common.serve_floor's relay to it at /floor
        self.ready_file = logdir / f"{name}.ready"
        config_path = logdir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self.stop_info: dict[str, Any] = {}
        super().__init__(name, self.command(config_path), logdir, stdin=True)

    def command(self, config_path: Path) -> list[str]:
        """The child that serves ``config_path`` on ``self.port`` and writes "ok" to the ready file."""
        cmd = [
            sys.executable,
            "-m",
            "loadtest.benchmarks.bench_overhead",
            "--serve-cluster",
            str(config_path),
        ]
        cmd += ["--serve-port", str(self.port), "--ready-file", str(self.ready_file)]
        return cmd + (["--floor-upstream", self.floor_upstream] if self.floor_upstream else [])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1/chat/completions"

    @property
    def floor_url(self) -> str | None:
        return f"http://{HOST}:{self.port}/floor/v1/chat/completions" if self.floor_upstream else None

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            text = self.ready_file.read_text().strip() if self.ready_file.exists() else ""
            if text == "ok":
                return time.monotonic() - t0
            if text or not self.alive():
                raise LegFailed(f"{self.name}: {text or f'exited ({self.p.returncode})'}\n{self.tail()}")
            time.sleep(0.5)
        raise LegFailed(f"{self.name}: not ready after {timeout_s:.0f} s\n{self.tail()}")

    def stop(self, grace_s: float = 90.0) -> None:
        if self.stopped:
            return
        t0 = time.monotonic()
        if self.alive() and self.p.stdin is not None:
            with contextlib.suppress(OSError):
                self.p.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(grace_s)
        exited = not self.alive()
        deadline = time.monotonic() + 5.0
        while not port_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        free_after_stop = port_free(self.port)
        super().stop()  # the process group if still alive, then every tagged leftover (haproxy …)
        self.stop_info = {
            "stop_s": _r(time.monotonic() - t0, 1),
            "exited_by_itself": exited,
            "exit_code": self.p.returncode,
            "port_free_after_stop": free_after_stop,
            "leftovers_killed": {str(pid): comm for pid, comm in self.leftovers.items()},
            "port_free": port_free(self.port),
        }

    def problems(self) -> list[str]:
        s = self.stop_info
        out = [] if s.get("port_free") else [f"{self.name}: port {self.port} still taken after stop"]
        if s.get("leftovers_killed"):
            out.append(f"{self.name}: killed leftovers after stop: {s['leftovers_killed']}")
        return out
