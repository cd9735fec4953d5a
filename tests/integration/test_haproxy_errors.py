"""A request that no gateway replica answers gets an OpenAI error, not HAProxy's plain text.

Ray's HAProxy answers a request whose gateway died before a byte of answer with its own error page,
which Ray writes as a ``text/plain`` "Internal Server Error" 500 (seen in the faults run). The
gateway replaces that page (deployments/haproxy_errors.py); here the app's only gateway replica is
killed while a request waits in its admission queue, and that request's client reads the answer."""

from __future__ import annotations

import json

import pytest
import ray

from deployments import haproxy_errors
from tests.integration.test_dataplane import MODEL, STALL_MODEL, _admission, _dp_cfg, _gateway_actor, _wait
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


def test_a_request_its_gateway_died_holding_gets_an_openai_503(dp) -> None:
    url = dp.base_url + "/chat/completions"
    a0 = _admission(dp)
    stall = {"model": STALL_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    holder = RawRequest(url, stall | {"max_tokens": 64}, {"x-surface": "tab"})
    holder.read_until(b'"content":"')  # tab's one slot is held: its engine went silent
    body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
    waiter = RawRequest(url, body, {"x-surface": "tab"})  # queued: not a byte of answer yet
    assert _wait(lambda: _admission(dp)["waiting"] == a0["waiting"] + 1, 20), _admission(dp)
    ray.kill(_gateway_actor(dp), no_restart=True)
    raw = waiter.read_response()
    holder.close()
    assert raw, "HAProxy closed the connection without an answer"
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert waiter.status == 503, raw[:300]
    assert b"retry-after: 1" in head.lower(), head
    assert json.loads(payload) == json.loads(haproxy_errors.error_response().partition(b"\r\n\r\n")[2])
