"""A look inside every Ray actor of an app, for the reliability tier and the soak and fault scripts:
PID, RSS, sockets, asyncio tasks; a gateway replica's admission counters, routing views and provider
adapters; an engine replica's streams. Killing and waiting for replicas, Ray's logs and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import httpx

# ------------------------------------------------------------------------------------------------
# Inside the actors
# ------------------------------------------------------------------------------------------------

GATEWAY = "Gateway"  # the app's ingress deployment (deployments/gateway/gateway.py)


def _make_probe() -> Any:
    """A closure, so cloudpickle ships it by value (an actor needs nothing of this module).

    Run by ``__ray_call__`` in an actor: its PID, and - on the event loop that runs a Serve
    replica's user code (a thread of its own; the gateway's runs on the replica's main loop) - its
    asyncio tasks, and:

    * in a gateway replica (it has ``admission``): its admission counters, the size of every table
      of each backend's routing view (``in_flight`` entries and their sum, ``live`` replicas,
      ``decision_counts`` reasons; the cache-aware policy's prefix index and session table with
      their bounds, and the replicas the index has a slot for), each provider adapter's
      per-request table (``flights``) and stats, and the race's policy snapshot;
    * in an engine replica (it has ``backend`` and ``ongoing``): its streams in progress (the
      aiohttp handlers run on the same loop, so their tasks are among ``tasks``: one per open
      connection, one per request), the connections its token server holds, and its engine's
      running and waiting requests.

    Each gateway replica has its own counters and views (HAProxy spreads the clients over them):
    callers sum over the replicas (``gateway_probes``).
    """

    gateway = _make_gateway_probe()
    inside = _make_loop_probe(gateway)

    def look(actor: Any) -> dict[str, Any]:
        import concurrent.futures
        import os

        impl = getattr(actor, "_replica_impl", None)
        obj: Any = None
        if impl is not None:
            wrapper = impl._user_callable_wrapper
            loop, obj = wrapper.event_loop, wrapper._callable
        else:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        if loop is None or getattr(loop, "_thread_id", None) in (None, threading.get_ident()):
            found = inside(loop, obj)
        else:
            fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

            def run() -> None:
                try:
                    fut.set_result(inside(loop, obj))
                except Exception as exc:
                    fut.set_exception(exc)

            loop.call_soon_threadsafe(run)
            found = fut.result(10)
        return {"pid": os.getpid(), **found}

    return look


def _make_gateway_probe() -> Any:
    """A gateway replica's tables, as a closure (shipped by value with the probe)."""

    def gateway(gw: Any) -> dict[str, Any]:
        import dataclasses

        c = gw.admission.controller.counters()
        views: dict[str, dict[str, int]] = {}
        for name, v in getattr(gw, "views", {}).items():
            s = v.snapshot()
            t = {
                "in_flight": len(s.in_flight),
                "in_flight_total": sum(s.in_flight.values()),
                "live": len(s.replicas),
                "decision_counts": len(s.decisions),
            }
            if v.policy is not None:
                t["index_blocks"] = len(v.policy.index)
                t["index_capacity"] = v.policy.index.capacity
                t["index_replicas"] = len(v.policy.index._bits)
                t["sessions"] = len(v.policy.sessions)
                t["session_capacity"] = v.policy.sessions.capacity
            views[name] = t
        providers = {
            name: {"flights": len(p._flights), **dataclasses.asdict(p.stats())}
            for name, p in getattr(gw, "providers", {}).items()
        }
        return {
            "counters": {**dataclasses.asdict(c), "balanced": c.balanced()},
            "views": views,
            "providers": providers,
            "policy": gw.attempts.snapshot(),
        }

    return gateway


def _make_loop_probe(gateway: Any) -> Any:
    """What runs on the replica's user-code loop: its tasks and objects, and the gateway's or the
    engine's own state; a closure like the probe."""

    def inside(loop: Any, obj: Any) -> dict[str, Any]:
        import gc

        tasks = asyncio.all_tasks(loop) if loop is not None else set()
        names: dict[str, int] = {}
        for t in tasks:
            coro = t.get_coro()
            key = getattr(coro, "__qualname__", type(coro).__name__)
            names[key] = names.get(key, 0) + 1
        res: dict[str, Any] = {"tasks": len(tasks), "task_names": names, "gc_objects": len(gc.get_objects())}
        if obj is not None and hasattr(obj, "admission"):
            res.update(gateway(obj))
        elif obj is not None and hasattr(obj, "backend") and hasattr(obj, "ongoing"):
            s = obj.backend.stats()
            res["engine"] = {
                "ongoing": obj.ongoing,
                "running": s.running,
                "waiting": s.waiting,
                "connections": len(obj._runner.server.connections),  # its token server's
            }
        return res

    return inside


def serve_actor_names(app: str) -> list[tuple[str, str]]:
    """(name, namespace) of the app's replicas (gateways, engines, provider budgets), the Serve
    controller and proxies."""
    import ray

    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name, ns = a["name"], a["namespace"]
        if (
            name.startswith(f"SERVE_REPLICA::{app}#")
            or name in ("SERVE_CONTROLLER_ACTOR",)
            or name.startswith("SERVE_PROXY_ACTOR")
        ):
            out.append((name, ns))
    return sorted(out)


def short_name(name: str) -> str:
    """SERVE_REPLICA::app#backend-x#abc → backend-x#abc."""
    return name.split("#", 1)[1] if name.startswith("SERVE_REPLICA::") else name


def actor_snapshot(app: str, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """name → {pid, rss_mb, sockets, fds, tasks, task_names, …} for every actor of the app (and Serve's)."""
    import psutil
    import ray

    look = _make_probe()
    refs = {}
    for name, ns in serve_actor_names(app):
        with contextlib.suppress(Exception):
            refs[name] = ray.get_actor(name, namespace=ns).__ray_call__.remote(look)
    out: dict[str, dict[str, Any]] = {}
    for name, ref in refs.items():
        try:
            info = ray.get(ref, timeout=timeout)
        except Exception:
            continue
        try:
            p = psutil.Process(info["pid"])
            info["rss_mb"] = p.memory_info().rss / 2**20
            info["sockets"] = len(p.net_connections(kind="inet"))
            info["fds"] = p.num_fds()
        except psutil.Error:
            continue
        out[short_name(name)] = info
    return out


def replica_ids(app: str, deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(
        a["name"][len(prefix) :]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    )


def kill_actor(app: str, deployment: str, replica: str, wait_s: float = 15.0) -> tuple[float, float | None]:
    """Kill a Serve replica's actor the way a crash would (Serve starts a new one); returns once its
    process is gone (``ray.kill`` only asks), or after ``wait_s``. Returns the monotonic times of
    the kill and of the first look that found the process gone (None: not seen gone)."""
    import os

    import ray

    actor = ray.get_actor(f"SERVE_REPLICA::{app}#{deployment}#{replica}", namespace="serve")
    pid: int | None = None
    with contextlib.suppress(Exception):
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    t_kill = time.monotonic()
    ray.kill(actor, no_restart=True)
    deadline = t_kill + wait_s
    while pid is not None and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return t_kill, time.monotonic()
        time.sleep(0.02)
    return t_kill, None


def replaced(app: str, deployment: str, killed: list[str], replicas: int) -> bool:
    """Serve has started new replicas for the killed ones and all ``replicas`` are running."""
    ids = replica_ids(app, deployment)
    return (
        not set(ids) & set(killed) and len(ids) == replicas and deployment_running(app, deployment, replicas)
    )


def deployment_running(app: str, deployment: str, replicas: int) -> bool:
    from ray import serve

    st = serve.status().applications.get(app)
    if st is None or deployment not in st.deployments:
        return False
    d = st.deployments[deployment]
    running = sum(
        n for state, n in d.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING"
    )
    return str(getattr(d.status, "value", d.status)) == "HEALTHY" and running == replicas


def gateway_probes(app: str, timeout: float = 15.0) -> dict[str, dict[str, Any]]:
    """What each gateway replica's actor reports (replica id → the probe's dict; see ``_make_probe``)."""
    import ray

    look = _make_probe()
    refs = {}
    for rid in replica_ids(app, GATEWAY):
        with contextlib.suppress(Exception):  # a replica that is just dying
            actor = ray.get_actor(f"SERVE_REPLICA::{app}#{GATEWAY}#{rid}", namespace="serve")
            refs[rid] = actor.__ray_call__.remote(look)
    out = {}
    for rid, ref in refs.items():
        with contextlib.suppress(Exception):
            out[rid] = ray.get(ref, timeout=timeout)
    return out


def gateway_counters(app: str) -> dict[str, dict[str, Any]]:
    """Each gateway replica's admission counters (replica id → counters)."""
    return {rid: p["counters"] for rid, p in gateway_probes(app).items()}


def gateway_policies(app: str) -> dict[str, dict[str, Any]]:
    """Each gateway replica's race policy snapshot (breakers, hedges, failovers)."""
    return {rid: p["policy"] for rid, p in gateway_probes(app).items()}


def provider_totals(app: str, backends: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The provider adapters' own totals (prompt and completion tokens, cost; requests settled with
    the provider's usage and requests that reached it but ended without), summed over the gateway
    replicas (each runs its own adapters)."""
    out: dict[str, dict[str, float]] = {}
    for p in gateway_probes(app).values():
        for name, s in p["providers"].items():
            if name in backends:
                t = out.setdefault(
                    name,
                    {"prompt": 0, "completion": 0, "cost": 0.0, "requests": 0, "unsettled": 0},
                )
                t["prompt"] += s["extra"].get("prompt_tokens_total", 0)
                t["completion"] += s["extra"].get("completion_tokens_total", 0)
                t["cost"] += s["extra"].get("cost_usd_total", 0.0)
                t["requests"] += s["requests_finished"]  # settled with the provider's usage
                t["unsettled"] += s["extra"].get("cancelled_requests", 0)  # reached it, ended without
    return out


def wait_idle(app: str, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Every gateway replica's counters once nothing is in flight (or the last read at the timeout)."""
    deadline = time.monotonic() + timeout
    c = gateway_counters(app)
    while any(x["in_flight"] for x in c.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        c = gateway_counters(app)
    return c


def log_dir() -> str:
    """This driver's Ray session's log folder (``session_latest`` may be another Ray on the box)."""
    import ray

    return ray._private.worker._global_node.get_logs_dir_path()


def metrics_text() -> str:
    """What Ray's metrics agent exports on this node (empty when it is not reachable)."""
    import ray

    port = ray._private.worker._global_node.metrics_export_port
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return ""


def find_in_logs(folder: str, needle: str) -> list[str]:
    """Files under ``folder`` whose bytes contain ``needle``."""
    from pathlib import Path

    hits = []
    raw = needle.encode()
    for p in Path(folder).rglob("*"):
        if p.is_file():
            with contextlib.suppress(OSError):
                if raw in p.read_bytes():
                    hits.append(str(p))
    return hits
