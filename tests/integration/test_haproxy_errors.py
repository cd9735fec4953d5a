"""A request that no gateway replica answers gets an OpenAI error, not HAProxy's plain text.

Ray's HAProxy answers a request whose gateway died before a byte of answer with its own error page,
which Ray writes as a ``text/plain`` "Internal Server Error" 500 (seen in the faults run). The
gateway replaces that page (deployments/haproxy_errors.py); here the app's only gateway replica is
killed while a request waits in its admission queue, and that request's client reads the answer."""

from __future__ import annotations

import json

import httpx
import pytest
import ray

from deployments import haproxy_errors
from loadtest.common.actor_probe import gateway_counters, replica_ids
from tests.integration.test_dataplane import MODEL, STALL_MODEL, _dp_cfg, _wait
from tests.rawhttp import RawRequest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dp(deploy):
    """test_dataplane's app under a name of its own: a gateway no earlier test sent traffic through.
    HAProxy reuses idle connections to a replica (`http-reuse always`); when a reused one breaks
    before any answer, HAProxy closes the client's connection without one, for the client to retry
    (seen when this test ran on test_dataplane's own app), and its error page is not what it sends.
    Here the waiter's request opens a connection of its own (the holder's is busy), as a first
    request to a replica does."""
    cfg = _dp_cfg().model_copy(update={"name": "llm-cluster-haperr"})
    return deploy(cfg, "/haperr")


def _waiting(dp) -> int:
    """The gateway's admission queue, read through Ray (no request through HAProxy: each would
    leave HAProxy an idle connection to the replica, which the waiter's request could reuse)."""
    return sum(c["waiting"] for c in gateway_counters(dp.cfg.name).values())


def _routed(dp) -> bool:
    try:
        return httpx.get(dp.url + "/healthz", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _one_kill(dp) -> tuple[RawRequest, bytes, str]:
    """Hold Tab's one slot, queue a second request behind it, kill the gateway: the waiter's answer."""
    url = dp.base_url + "/chat/completions"
    w0 = _waiting(dp)
    stall = {"model": STALL_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    holder = RawRequest(url, stall | {"max_tokens": 64}, {"x-surface": "tab"})
    holder.read_until(b'"content":"')  # tab's one slot is held: its engine went silent
    body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
    waiter = RawRequest(url, body, {"x-surface": "tab"})  # queued: not a byte of answer yet
    assert _wait(lambda: _waiting(dp) == w0 + 1, 20), gateway_counters(dp.cfg.name)
    (rid,) = replica_ids(dp.cfg.name, "Gateway")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{dp.cfg.name}#Gateway#{rid}", namespace="serve"), no_restart=True)
    raw = waiter.read_response()
    holder.close()
    return waiter, raw, rid


def test_a_request_its_gateway_died_holding_gets_an_openai_503(dp) -> None:
    # When HAProxy gave the waiter a reused idle connection it closes the client's connection with
    # no answer (see the fixture): then the replica Serve starts in the killed one's place is tried
    # again, at most twice more. Without the fix every answer that comes is Ray's text/plain 500.
    for _ in range(3):
        waiter, raw, killed = _one_kill(dp)
        if raw:
            break
        assert _wait(lambda k=killed: replica_ids(dp.cfg.name, "Gateway") not in ([], [k]), 60)
        assert _wait(lambda: len(gateway_counters(dp.cfg.name)) == 1, 60)
        assert _wait(lambda: _routed(dp), 60)
    assert raw, "HAProxy closed the connection without an answer, 3 times"
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert waiter.status == 503, raw[:300]
    assert b"retry-after: 1" in head.lower(), head
    # HAProxy's page (the process died at once), or the gateway's own 503 when the process had a
    # moment to answer on its way out (its ASGI entry answers any exit so; CI once saw uvicorn's
    # plain-text 500 there, before it did)
    page = json.loads(haproxy_errors.error_response().partition(b"\r\n\r\n")[2])
    got = json.loads(payload)
    assert got == page or (
        got["error"]["type"] == "overloaded_error" and got["error"]["code"] == "overloaded"
    ), got
