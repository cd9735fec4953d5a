"""A provider backend's RPM / TPM / in-flight budget belongs to its app (issue 15 item 7).

It used to be a detached Ray actor named by the backend alone, in one namespace for every app:
deleting the app left it running, and a second app with a backend of the same name shared (and
reconfigured) the first one's budget. Now it is the app's own ``budget-<backend>`` deployment.
Two apps here, each with a provider backend named ``openai-p`` allowed one request in flight, in
the session's Ray Serve, against one loopback OpenAI server (a stalled stream holds a slot until
its client leaves).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.config import ClusterConfig, parse_config
from fixtures.servers import OpenAIServer
from tests.rawhttp import RawRequest

pytestmark = pytest.mark.integration

BACKEND = "openai-p"


def _config(name: str, base_url: str, gateways: int) -> ClusterConfig:
    return parse_config(
        {
            "name": name,
            "server": {"gateway_replicas": gateways},
            "models": [{"name": "m", "tokenizer": "@tiny", "context_window": 4096, "default_max_tokens": 8}],
            "backends": [
                {
                    "name": BACKEND,
                    "kind": "provider",
                    "model": "m",
                    "provider": {
                        "api": "openai",
                        "base_url": base_url,
                        "max_in_flight": 1,
                    },
                }
            ],
            "surfaces": [{"name": "chat", "priority": 1}],
            "routes": [{"model": "m", "candidates": [BACKEND]}],
        }
    )


@pytest.fixture(scope="module")
def upstream() -> Iterator[OpenAIServer]:
    with OpenAIServer(output_tokens=8) as srv:
        yield srv


def _body(stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}


def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(pred())


def _statuses(url: str, n: int) -> list[int]:
    """n requests, each on its own connection (HAProxy spreads them over the gateway replicas)."""
    out = []
    for _ in range(n):
        with httpx.Client(timeout=30, trust_env=False) as c:
            r = c.post(url + "/v1/chat/completions", json=_body(False))
            out.append(r.status_code)
    return out


def _budget_actors() -> list[str]:
    """Named actors of every namespace that hold a budget (Serve names its replicas' actors)."""
    import ray

    names = (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
    return sorted(n for n in names if "budget" in n)


def test_the_budget_is_one_per_app_and_goes_with_it(deploy, upstream: OpenAIServer) -> None:
    from ray import serve

    a = deploy(_config("llmc-budget-a", upstream.base_url, 2), route_prefix="/budget-a")
    b = deploy(_config("llmc-budget-b", upstream.base_url, 1), route_prefix="/budget-b")
    try:
        upstream.push_faults("stall:2")  # two tokens, then silence: the stream holds A's one slot
        held = RawRequest(a.url + "/v1/chat/completions", _body(True))
        held.read_until(b'"content":"')
        assert held.status == 200
        # Every gateway replica of A sees the slot taken: one budget for the app.
        assert _statuses(a.url, 6) == [429] * 6
        # App B's backend has the same name and a budget of its own: admitted.
        assert _statuses(b.url, 1) == [200]
        held.close()  # the client leaves during the silence: the gateway cancels, the slot returns
        assert _wait(lambda: _statuses(a.url, 1) == [200], 20)
        assert [r.outcome for r in upstream.stats().records if r.fault.startswith("stall")] == ["disconnect"]

        names = _budget_actors()
        assert any("llmc-budget-a" in n and f"budget-{BACKEND}" in n for n in names), names
        assert not any(n.startswith("provider-budget:") for n in names), names  # no detached actor
        serve.delete("llmc-budget-a")
        _wait(lambda: not any("llmc-budget-a" in n for n in _budget_actors()), timeout=30)
        names = _budget_actors()
        assert not any("llmc-budget-a" in n for n in names), names  # gone with its app
        assert any("llmc-budget-b" in n for n in names), names  # the other app's is untouched
    finally:
        for app in ("llmc-budget-a", "llmc-budget-b"):
            with contextlib.suppress(Exception):  # already gone
                serve.delete(app)
