"""The local launcher's environment for Ray's processes: an operator's own port settings are kept,
the rest get free ports (two clusters on one machine must not collide on Ray's fixed defaults)."""

from __future__ import annotations

import pytest

from deployments import local


def test_operator_port_settings_win(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path))
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    monkeypatch.setenv("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "18500")
    monkeypatch.delenv("RAY_SERVE_HAPROXY_METRICS_PORT", raising=False)
    env = local._cluster_env()
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == "18500"
    chosen = int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])
    assert chosen not in (9101, 0)
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30"
