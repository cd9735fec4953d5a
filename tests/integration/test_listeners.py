"""What the local cluster exposes (issue 47): the internal credential in no log, every listener on
the configured host, HAProxy's admin socket ours alone, and slow clients cut off.

The real HAProxy on Serve 2.60's own config, as the launcher rewrites it (deployments/launcher/
haproxy_launch.py), started the way Serve starts it: listeners, socket, header deadline, per-client
cap and the HAProxy's life tied to its parent, each in a second or two, with no Ray. Then the
session's cluster (configs/local.yaml): its Ray logs and its listeners; and a small simulated app
with a one-second body deadline.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import select
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.config import load_config
from deployments.internal import internal_token
from deployments.launcher import local
from deployments.launcher.haproxy_launch import MARK, Limits, install
from fixtures.haproxy_admin import admin
from loadtest.common.actor_probe import find_in_logs, log_dir

pytestmark = pytest.mark.integration

HEADER_MS = 2000  # the stand-alone HAProxy's header deadline
CAP = 3  # and its per-client cap


# -- what listens where (from /proc, as `ss -ltnp` reads it) --------------------------------------
def _addr(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip.ipv4_mapped or ip)


def _listening() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of this machine: inode → (address, port)."""
    out: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                host, port = f[1].split(":")
                out[int(f[9])] = (_addr(host), int(port, 16))
    return out


def listeners(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP listener these processes hold."""
    socks, found = _listening(), []
    for pid in pids:
        name = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]).decode(errors="replace")
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and int(link[8:-1]) in socks:
                        found.append((pid, name, *socks[int(link[8:-1])]))
    return sorted(set(found))


def _descendants(root: int) -> set[int]:
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, todo = set(), [root]
    while todo:
        at = todo.pop()
        kids = [p for p, pp in parent.items() if pp == at and p not in out]
        out.update(kids)
        todo += kids
    return out


def _loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


# -- the stand-alone HAProxy ------------------------------------------------------------------------
@dataclass
class Hap:
    parent: subprocess.Popen[str]
    pid: int
    port: int
    folder: Path  # Serve's per-node folder: config and admin socket

    @property
    def socket(self) -> Path:
        return self.folder / "admin.sock"


def _serve_config(folder: Path, port: int) -> Path:
    """HAProxy's config exactly as Ray Serve renders it (no apps: HAProxy answers /-/routes)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        socket_path=str(folder / "admin.sock"),
        server_state_base=str(folder),
        server_state_file=str(folder / "server-state"),
        stats_port=local.free_port(),
        metrics_port=local.free_port(),
        metrics_enabled=False,
        has_received_routes=True,
        has_received_servers=True,
        is_head=True,
    )
    api = HAProxyApi(cfg, {}, config_file_path=str(folder / "haproxy.cfg"))
    api._generate_config_file_internal()
    return folder / "haproxy.cfg"


@pytest.fixture
def hap(tmp_path: Path) -> Iterator[Hap]:
    """Our launcher run as Serve runs it (``<binary> -db -f <config> -dR``), by a parent process
    that the PDEATHSIG test kills."""
    (tmp_path / "node").mkdir()
    port = local.free_port()
    config = _serve_config(tmp_path / "node", port)
    launcher = install(tmp_path, local.haproxy_binary(), Limits("127.0.0.1", HEADER_MS, CAP))
    spawn = "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); p.wait()"
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn, str(launcher), "-db", "-f", str(config), "-dR"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    h = Hap(parent, int(parent.stdout.readline()), port, tmp_path / "node")
    deadline = time.monotonic() + 20
    while not _answers(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield h
    finally:
        for pid in (h.pid, parent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        parent.wait()


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"GET /-/routes HTTP/1.1\r\nHost: x\r\n\r\n")
        return s.recv(64).startswith(b"HTTP/1.1 200")
    return False


def _trickle(s: socket.socket, piece: bytes, every_s: float, max_s: float) -> float:
    """Send ``piece`` every ``every_s`` until the server answers or closes (at most ``max_s``);
    the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s and not select.select([s], [], [], every_s)[0]:
        with contextlib.suppress(OSError):
            s.sendall(piece)
    return time.monotonic() - t0


def _response(s: socket.socket, timeout: float) -> bytes:
    """One HTTP response (its head and Content-Length bytes of body), or what came before the
    connection closed or went quiet for ``timeout``."""
    s.settimeout(timeout)
    buf = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while True:
            head, sep, body = buf.partition(b"\r\n\r\n")
            lengths = [ln for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")]
            if sep and lengths and len(body) >= int(lengths[0].split(b":", 1)[1]):
                return buf
            chunk = s.recv(65536)
            if not chunk:
                return buf
            buf += chunk
    return buf


def test_the_rewritten_serve_config_binds_every_listener_on_the_host_and_locks_the_socket(hap: Hap) -> None:
    found = listeners({hap.pid})
    assert len(found) == 3, found  # the API, the stats page, the Prometheus exporter
    assert all(_loopback(addr) for _, _, addr, _ in found), found
    assert stat.S_IMODE(hap.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(hap.folder.stat().st_mode) == 0o700


def test_headers_sent_slowly_are_cut_off_at_the_deadline(hap: Hap) -> None:
    """HAProxy's own 408 (text/html: its HTTP/1 layer sends only its built-in pages), then it closes."""
    with socket.create_connection(("127.0.0.1", hap.port), timeout=10) as s:
        s.sendall(b"GET /-/routes HTTP/1.1\r\nHost: x\r\n")
        took = _trickle(s, b"X-Slow: 1\r\n", 0.2, 3 * HEADER_MS / 1000)  # never the blank line
        raw = _response(s, 5)
    assert raw.startswith(b"HTTP/1.1 408"), raw[:300]
    assert b"connection: close" in raw.lower()
    assert HEADER_MS / 1000 - 0.1 <= took < HEADER_MS / 1000 + 1.5, took


def _connect(port: int) -> socket.socket | None:
    """A connection, or None when it was reset as it opened (how HAProxy refuses one)."""
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except ConnectionResetError:
        return None


def _counted(hap: Hap) -> int:
    """The open connections HAProxy's per-client table counts now, from its admin socket."""
    total = 0
    for name in re.findall(r"# table: (\S+),", admin(hap.socket, "show table")):
        total += sum(int(n) for n in re.findall(r"conn_cur=(\d+)", admin(hap.socket, f"show table {name}")))
    return total


def test_one_client_address_holds_at_most_its_cap_of_connections(hap: Hap) -> None:
    """CAP + 1 connections at once: exactly one is closed as it opens (which one depends on which of
    HAProxy's threads accepts first), the others stay open and are served. The fixture's readiness
    probe is closed on our side before HAProxy may have counted its close: wait for its count to
    drop first, or it takes one of the CAP places (seen once in CI: two of four refused)."""
    deadline = time.monotonic() + 5
    while _counted(hap) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _counted(hap) == 0, "the readiness probe's connection is still counted"
    conns = [_connect(hap.port) for _ in range(CAP + 1)]
    opened = [s for s in conns if s is not None]
    try:
        time.sleep(0.3)  # a refused connection reads as closed by now; a kept one has nothing to read
        closed = select.select(opened, [], [], 0)[0]
        kept = [s for s in opened if s not in closed]
        assert len(conns) - len(kept) == 1 and len(kept) == CAP, (len(conns), len(opened), len(closed))
        assert _counted(hap) == CAP, "HAProxy's table counts the kept connections"
        kept[0].sendall(b"GET /-/routes HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(kept[0], 1.0).startswith(b"HTTP/1.1 200"), "a connection within the cap"
    finally:
        for s in opened:
            s.close()
    time.sleep(0.2)
    assert _answers(hap.port), "the cap counts open connections: closed ones free their place"


def test_haproxy_ends_with_the_process_that_started_it(hap: Hap) -> None:
    os.kill(hap.parent.pid, 9)  # Serve's HAProxy manager killed without its clean-up
    hap.parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{hap.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{hap.pid}").exists(), "HAProxy outlived its parent"
    assert not _answers(hap.port)


# -- the session's cluster --------------------------------------------------------------------------
def test_the_internal_credential_is_in_no_log_of_the_cluster(cluster) -> None:
    """Ray's runtime-env agent and the workers' core logs write a runtime_env's env_vars whole:
    the credential reaches the replicas by inheritance instead, and no file of the session's log
    folder holds it."""
    token = internal_token()
    routing = cluster.status()["routing"]  # a gateway answers this process's credential ...
    engines = {rid for view in routing.values() for rid in view["replicas"]}
    assert engines and set(cluster.replica_stats()) == engines  # ... and so does every engine
    logs = log_dir()
    assert find_in_logs(logs, "Gateway"), "not the log folder of this Ray session"
    assert (Path(logs) / "runtime_env_agent.log").stat().st_size > 0
    assert find_in_logs(logs, token) == []


def _refuses_without_ray_token(port: int) -> bool:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            ch.unary_unary("/ray.serve.ASGIService/HandleRequest")(b"", timeout=10)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def test_every_listener_of_the_cluster_is_on_the_configured_host(cluster) -> None:
    """`host: 127.0.0.1`: HAProxy (API, stats, Prometheus), Ray's metrics port, agents and gRPC
    servers, the gateways and engines all on loopback. One exception, hard-coded in Serve 2.60
    (serve/_private/replica.py, ``add_port_to_grpc_server(self._server, "[::]:0")``): each
    replica's inter-deployment gRPC server, which refuses a caller without Ray's cluster token."""
    assert _loopback(cluster.cfg.server.host)
    found = listeners(_descendants(os.getpid()))
    assert any(name.endswith("haproxy") for _, name, _, _ in found), found
    wide = [(pid, name, addr, port) for pid, name, addr, port in found if not _loopback(addr)]
    for pid, name, addr, port in wide:
        assert name.startswith("ray::ServeReplica") and addr == "::", (pid, name, addr, port)
        assert _refuses_without_ray_token(port), (pid, name, port)
    assert len({pid for pid, *_ in wide}) == len(wide), "one such server per replica"
    hap = Path(local.HAPROXY_DIR)
    assert stat.S_IMODE(hap.stat().st_mode) == 0o700
    (sock,) = hap.glob("*/admin.sock")
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    config = (sock.parent / "haproxy.cfg").read_text()
    assert MARK in config and "timeout http-request" in config and "track-sc0 src" in config


# -- the body deadline, on an app of its own ----------------------------------------------------------
@pytest.fixture(scope="module")
def slow_body_app(deploy):
    cfg = load_config("configs/sim-local.yaml")
    backends = [b.model_copy(update={"replicas": 1}) for b in cfg.backends]
    server = cfg.server.model_copy(update={"body_timeout_s": 1.0})
    cfg = cfg.model_copy(update={"name": "llmc-slow-body", "server": server, "backends": backends})
    return deploy(cfg, "/slowbody")


def test_a_trickling_body_gets_an_openai_408_at_the_gateways_deadline(slow_body_app) -> None:
    path = f"{slow_body_app.route_prefix}/v1/chat/completions"
    with socket.create_connection(("127.0.0.1", slow_body_app.port), timeout=10) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += "Content-Length: 1000\r\n\r\n"
        s.sendall(head.encode() + b'{"model": ')
        took = _trickle(s, b" ", 0.1, 5.0)  # a byte every 0.1 s: the 1,000 would take 100 s
        raw = _response(s, 5)
    head_in, _, body = raw.partition(b"\r\n\r\n")
    assert head_in.startswith(b"HTTP/1.1 408"), raw[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    assert 0.9 <= took < 3.0, took
