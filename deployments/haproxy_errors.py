"""HAProxy's own answer, in the OpenAI shape.

Behind Ray Serve's HAProxy, a request that no gateway replica answers (the replica it was sent to
died before a byte of answer, or none is up) gets HAProxy's error page. Ray writes that page once
per node, ``<config dir>/<node id>/500.http``, and maps HAProxy's 502, 503 and 504 onto it: a
``text/plain`` "Internal Server Error" (serve/_private/haproxy.py,
``_initialize_directories_and_error_files``). Seen in the faults run (2026-12-01): a gateway killed
under load answered a request it had just been handed with exactly that, the one error a client
got that was not an OpenAI error object.

Each gateway replica and each engine replica replaces the page on its node, before it serves
(Serve runs HAProxy on every node that holds a replica, and the manifest's Service sends clients to
every worker pod whose proxy is healthy, engine pods included): a 503 with ``Retry-After`` and the
OpenAI error object, so that a client sees the same kind of error as any other overload, and the
official SDKs, which retry a 503, retry it. Only Ray's own file is replaced, where Ray put it: on a
node without HAProxy, or if Ray moves the file, nothing is written.

HAProxy reads the page when it (re)loads. Serve reloads it when the replicas it routes to change,
which on one node follows a replica's start; on a pod of engines it does not (its HAProxy routes to
the gateways, elsewhere): the lab's engine pods and gateway pod served Ray's page all along (a
killed gateway's clients got it in the 14th rehearsal). So a replica that replaced the page asks its
node's HAProxy manager to reload (:func:`request_reload`): Serve's own graceful reload with the
config as it stands, through a private method of Ray Serve 2.60's ``HAProxyManager`` actor
(``_reload_haproxy``; where it is missing, the page waits for Serve's next reload, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from enum import Enum
from pathlib import Path

CONFIG_LOC_ENV = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"
DEFAULT_CONFIG_LOC = "/tmp/haproxy-serve/haproxy.cfg"  # Ray 2.60's default for the variable
ERROR_FILE = "500.http"
PROXY_ACTOR = "SERVE_PROXY_ACTOR"  # Serve's per-node proxy (here its HAProxy manager): <this>-<node id>
SERVE_NAMESPACE = "serve"
log = logging.getLogger("ray.serve")
RETRY_AFTER_S = 1
MESSAGE = (
    "No gateway replica answered this request (the one it reached went away before answering, "
    "or none is up yet); nothing was generated for it. Retry."
)


def error_file_path(node_id: str, config_loc: str | None = None) -> Path:
    """Where Ray's HAProxy manager on node ``node_id`` keeps its error page."""
    loc = config_loc or os.environ.get(CONFIG_LOC_ENV) or DEFAULT_CONFIG_LOC
    return Path(os.path.dirname(loc)) / node_id / ERROR_FILE


def error_response() -> bytes:
    """The whole HTTP response HAProxy sends as is (an errorfile holds the status line too)."""
    body = json.dumps(
        {
            "error": {
                "message": MESSAGE,
                "type": "overloaded_error",
                "param": None,
                "code": "gateway_unavailable",
            }
        },
        separators=(",", ":"),
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        "Cache-Control: no-cache\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode("ascii") + body


class Installed(Enum):
    ABSENT = "absent"  # no page of Ray's here (no HAProxy on this node yet, or it moved): none written
    OURS = "ours"  # ours was in place already
    REPLACED = "replaced"  # Ray's page replaced now: HAProxy serves it from its next reload


def install(node_id: str, config_loc: str | None = None) -> Installed:
    """Replace Ray's page on this node with ours. Atomic (a rename), so an HAProxy reloading
    meanwhile reads one page or the other, never half of one."""
    path = error_file_path(node_id, config_loc)
    want = error_response()
    try:
        if not path.is_file():
            return Installed.ABSENT
        if path.read_bytes() == want:
            return Installed.OURS
        tmp = path.with_name(f".{ERROR_FILE}.{os.getpid()}")
        tmp.write_bytes(want)
        os.replace(tmp, path)
        return Installed.REPLACED
    except OSError:
        with contextlib.suppress(OSError):
            path.with_name(f".{ERROR_FILE}.{os.getpid()}").unlink()
        return Installed.ABSENT


def request_reload(node_id: str) -> None:
    """Ask this node's HAProxy manager for Serve's graceful reload (it re-reads the page). Not
    waited for: the manager reloads once its HAProxy is up."""
    import ray

    try:
        manager = ray.get_actor(f"{PROXY_ACTOR}-{node_id}", namespace=SERVE_NAMESPACE)
        manager._reload_haproxy.remote()
    except Exception as exc:  # no such actor (Serve's Python proxy), or Ray's private method moved
        log.warning("HAProxy error page: could not ask node %s's HAProxy to reload: %r", node_id, exc)


def _install_and_load(node_id: str) -> None:
    if install(node_id) is Installed.REPLACED:
        request_reload(node_id)


def start(node_id: str) -> asyncio.Task[None]:
    """What a replica does as it starts (gateway and engine alike): our page in place on its node
    and loaded now, and kept so (:func:`keep_installed`); the task is the replica's to hold."""
    _install_and_load(node_id)
    return asyncio.get_running_loop().create_task(keep_installed(node_id))


async def keep_installed(node_id: str, period_s: float = 10.0, early_s: float = 30.0) -> None:
    """``install`` again every second for ``early_s``, then every ``period_s`` (the replica
    installed it once as it started): on a node where HAProxy starts after this replica (an engine
    pod's, started once the engines are up), Ray's page is written after ours; a replacement asks
    for a reload (off the event loop: it asks the GCS for the manager)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while True:
        await asyncio.sleep(1.0 if loop.time() - t0 < early_s else period_s)
        await asyncio.to_thread(_install_and_load, node_id)
