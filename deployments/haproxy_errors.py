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
every worker pod whose proxy is healthy, engine pods included) (HAProxy reads it when it
(re)loads, and it reloads when a replica joins): a 503 with ``Retry-After`` and the OpenAI error
object, so that a client sees the same kind of error as any other overload, and the official SDKs,
which retry a 503, retry it. Only Ray's own file is replaced, where Ray put it: on a node without
HAProxy, or if Ray moves the file, nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

CONFIG_LOC_ENV = "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"
DEFAULT_CONFIG_LOC = "/tmp/haproxy-serve/haproxy.cfg"  # Ray 2.60's default for the variable
ERROR_FILE = "500.http"
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


def install(node_id: str, config_loc: str | None = None) -> bool:
    """Replace Ray's page on this node with ours; True when the page in place is ours. Atomic (a
    rename), so an HAProxy reloading meanwhile reads one page or the other, never half of one."""
    path = error_file_path(node_id, config_loc)
    want = error_response()
    try:
        if not path.is_file():
            return False
        if path.read_bytes() == want:
            return True
        tmp = path.with_name(f".{ERROR_FILE}.{os.getpid()}")
        tmp.write_bytes(want)
        os.replace(tmp, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            path.with_name(f".{ERROR_FILE}.{os.getpid()}").unlink()
        return False


def start(node_id: str) -> asyncio.Task[None]:
    """What a replica does as it starts (gateway and engine alike): our page in place on its node
    now, and kept there (:func:`keep_installed`); the task is the replica's to hold."""
    install(node_id)
    return asyncio.get_running_loop().create_task(keep_installed(node_id))


async def keep_installed(node_id: str, period_s: float = 10.0) -> None:
    """``install`` again every ``period_s`` (the replica installed it once as it started): on a node
    where HAProxy starts after this replica, Ray's page is written after ours; HAProxy takes ours at
    its next reload (a replica joining)."""
    while True:
        await asyncio.sleep(period_s)
        install(node_id)
