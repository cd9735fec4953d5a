"""A request never outlives its surface's deadline: a self-hosted replica that goes silent after its
first tokens must not hold the client (the providers' adapters have a between-tokens clock of their
own; the gateway's race ends a silent engine stream at the deadline or after
policies.stream_idle_timeout_s)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from loadtest.common.reliability import STALL, SURFACE_DEADLINE_S

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

MARGIN_S = 3.0


def test_a_stream_stalled_after_its_first_tokens_ends_by_its_deadline(rel) -> None:
    deadline = SURFACE_DEADLINE_S["tab"]
    body = {"model": STALL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "stream": True}
    t0 = time.monotonic()
    events: list[dict] = []
    try:
        with httpx.stream(
            "POST",
            rel.base_url + "/chat/completions",
            json=body,
            headers=rel.keys.headers("tab"),
            timeout=httpx.Timeout(deadline + MARGIN_S),
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.ReadTimeout:
        pytest.fail(f"no end of stream {time.monotonic() - t0:.1f} s after the start (deadline {deadline} s)")
    took = time.monotonic() - t0
    assert "error" in events[-1], events[-1]  # a clean terminal error event ...
    assert took < deadline + MARGIN_S, took  # ... by the deadline
