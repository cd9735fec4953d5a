"""The gateway's body read (deployments/gateway/http_api.py ``read_body``): a body must arrive in full
within its deadline, else a 408 OpenAI error; one that arrives in time is read whole."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.wire.errors import PayloadTooLarge, RequestTimeout
from deployments.gateway.http_api import read_body

SCOPE: dict[str, Any] = {"headers": [(b"content-length", b"100")]}


def _trickle(pieces: int, every_s: float) -> Any:
    sent = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        await asyncio.sleep(every_s)
        sent += 1
        return {"type": "http.request", "body": b"x", "more_body": sent < pieces}

    return receive


def test_a_trickling_body_gets_a_408_at_its_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout) as info:
        asyncio.run(read_body(SCOPE, _trickle(100, 0.05), 1 << 20, timeout_s=0.3))
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.0, took
    err = info.value.to_openai()["error"]
    assert info.value.status_code == 408 and err["code"] == "request_timeout"
    assert err["type"] == "invalid_request_error" and "0.3 s" in err["message"]


def test_a_body_that_arrives_in_time_is_read_whole() -> None:
    assert asyncio.run(read_body(SCOPE, _trickle(5, 0.01), 1 << 20, timeout_s=2.0)) == b"xxxxx"
    assert asyncio.run(read_body(SCOPE, _trickle(3, 0.0), 1 << 20)) == b"xxx"  # no deadline


def test_the_size_limit_still_applies_under_a_deadline() -> None:
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body({"headers": []}, _trickle(10, 0.0), 4, timeout_s=5.0))
