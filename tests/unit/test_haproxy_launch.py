"""The rewrite of Serve's HAProxy config (deployments/launcher/haproxy_launch.py) on the lines Ray
Serve 2.60's template writes: listeners on the configured host, the admin socket 600, a header deadline, a
per-client connection cap; idempotent; and the launcher Serve starts.
(tests/integration/test_listeners.py runs the real HAProxy on the real template's output.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from deployments.launcher.haproxy_launch import MARK, Limits, install, rewrite

# What Serve's template renders (comments and the backends left out), for host 127.0.0.1.
SERVE = """global
    log 127.0.0.1:514 local0 info
    stats socket /tmp/x/n/admin.sock mode 666 level admin expose-fd listeners
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    errorfile 503 /tmp/x/n/500.http
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 127.0.0.1:8000
    log global
    acl healthcheck path -i /-/healthz
backend default_backend
    http-request return status 404
listen stats
  bind *:8404
  stats enable
"""
LIM = Limits("127.0.0.1", header_timeout_ms=10_000, max_conns_per_client=64)


def _section(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(name) + 1
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    return [ln.strip() for ln in lines[start:end]]


def test_every_listener_binds_the_configured_host() -> None:
    out = rewrite(SERVE, LIM)
    binds = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("bind ")]
    assert binds == ["bind 127.0.0.1:9101", "bind 127.0.0.1:8000", "bind 127.0.0.1:8404"]


def test_the_admin_socket_is_ours_alone() -> None:
    out = rewrite(SERVE, LIM)
    assert "stats socket /tmp/x/n/admin.sock mode 600 level admin expose-fd listeners" in out
    assert "mode 666" not in out


def test_a_header_deadline_in_defaults() -> None:
    defaults = _section(rewrite(SERVE, LIM), "defaults")
    assert "timeout http-request 10000ms" in defaults
    assert "timeout client 3600s" in defaults  # Serve's own settings stay


def test_a_per_client_cap_on_the_api_frontend_only() -> None:
    out = rewrite(SERVE, LIM)
    api = _section(out, "frontend http_frontend")
    assert api[0] == "bind 127.0.0.1:8000"
    assert "tcp-request connection track-sc0 src" in api
    assert "tcp-request connection reject if { sc0_conn_cur gt 64 }" in api
    assert any(ln.startswith("stick-table type ipv6") and "conn_cur" in ln for ln in api)
    assert out.count("track-sc0") == 1
    no_cap = rewrite(SERVE, Limits("127.0.0.1", 10_000, None))
    assert "track-sc0" not in no_cap and "stick-table" not in no_cap


def test_a_wildcard_host_keeps_the_wildcard_binds() -> None:
    out = rewrite(SERVE.replace("bind 127.0.0.1:8000", "bind *:8000"), Limits("0.0.0.0", 5000))
    assert "bind :9101" in out and "bind *:8000" in out and "bind *:8404" in out
    assert "timeout http-request 5000ms" in out and "mode 600" in out


def test_the_rewrite_is_done_once_and_replaces_a_deadline_serve_set() -> None:
    once = rewrite(SERVE, LIM)
    assert rewrite(once, Limits("10.0.0.1", 1, 1)) == once
    assert MARK in once
    serve_set = SERVE.replace(
        "    timeout client 3600s\n", "    timeout client 3600s\n    timeout http-request 30s\n"
    )
    defaults = _section(rewrite(serve_set, LIM), "defaults")
    assert [ln for ln in defaults if ln.startswith("timeout http-request")] == [
        "timeout http-request 10000ms"
    ]


def test_the_launcher_rewrites_the_config_then_runs_the_binary_with_serves_arguments(tmp_path: Path) -> None:
    """The launcher as Serve runs it (``<launcher> -db -f <config> ...``), with a stand-in binary
    that prints its arguments and the config it was given."""
    node = tmp_path / "node"
    node.mkdir()
    cfg = node / "haproxy.cfg"
    cfg.write_text(SERVE)
    fake = tmp_path / "fake-haproxy"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint(sys.argv)\nprint(open(sys.argv[3]).read())\n")
    fake.chmod(0o755)
    launcher = install(tmp_path, str(fake), Limits("127.0.0.1", 3000, 8))
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o700
    out = subprocess.run(
        [str(launcher), "-db", "-f", str(cfg), "-dR"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert out.splitlines()[0] == str([str(fake), "-db", "-f", str(cfg), "-dR"])
    assert "timeout http-request 3000ms" in out and "sc0_conn_cur gt 8" in out
    assert cfg.read_text() == rewrite(SERVE, Limits("127.0.0.1", 3000, 8))
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o700  # the admin socket's folder
