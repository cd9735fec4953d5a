"""Issue 40 item 3 on a local Ray Serve: every replica of a backend dies under load. A request then
waits for a replacement up to its surface's queue deadline and past it gets a 503 ``no_capacity``
with Retry-After, never a 502 from a dead replica; a route with a provider candidate is served by
the provider at once; once Serve has replaced the replicas every request is answered again."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.config import parse_config
from fixtures.replicas import kill_replica
from fixtures.servers.openai_server import OpenAIServer
from tests.integration.test_failover_hedging import KEY, _provider, _sim

pytestmark = pytest.mark.integration

APP = "llm-cluster-nocap"


@pytest.fixture(scope="module")
def nocap(deploy):
    with OpenAIServer(api_key=KEY, output_tokens=4) as oai:
        tiny = {"tokenizer": "@tiny", "default_max_tokens": 4}
        cfg = parse_config(
            {
                "name": APP,
                "server": {"gateway_replicas": 1},
                "models": [
                    {"name": "only-sim", "context_window": 4096, **tiny},
                    {"name": "sim-then-provider", "context_window": 4096, **tiny},
                ],
                "backends": [
                    _sim("sim-only", "only-sim", replicas=2),
                    _sim("sim-first", "sim-then-provider"),
                    _provider("prov-after", "openai", oai.base_url, "sim-then-provider"),
                ],
                "surfaces": [{"name": "chat", "priority": 1, "queue_deadline_ms": 1000}],
                "routes": [{"model": "sim-then-provider", "candidates": ["sim-first", "prov-after"]}],
            }
        )
        yield deploy(cfg, route_prefix="/nocap")


def _replicas(cluster, backend: str) -> list[str]:
    return sorted(cluster.status()["routing"][backend]["replicas"])


class _Load:
    """One client sending a request after another to ``model`` until stopped (bounded)."""

    def __init__(self, cluster, model: str) -> None:
        self.url, self.model = cluster.base_url + "/chat/completions", model
        self.seen: list[tuple[float, int, str, str | None, str | None, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=30) as c:
            for _ in range(2000):  # ~a minute at most
                if self.stop.is_set():
                    return
                t0 = time.monotonic()
                r = c.post(self.url, json=body)
                code = r.json().get("error", {}).get("code") if r.status_code != 200 else ""
                backend = r.headers.get("x-llmc-backend")
                self.seen.append(
                    (
                        t0,
                        r.status_code,
                        code or "",
                        r.headers.get("retry-after"),
                        backend,
                        time.monotonic() - t0,
                    )
                )
                time.sleep(0.05)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(60)


def test_every_replica_dead_is_a_503_with_retry_after_then_served_again(nocap) -> None:
    before = {b: _replicas(nocap, b) for b in ("sim-only", "sim-first")}
    assert len(before["sim-only"]) == 2 and len(before["sim-first"]) == 1, before
    only, mixed = _Load(nocap, "only-sim"), _Load(nocap, "sim-then-provider")
    time.sleep(1.0)
    killed_at = time.monotonic()
    # All at once: killed one after another, the first one's replacement could serve before the
    # last one died, and the outage would not be felt (a CI run at 736376c).
    with ThreadPoolExecutor(len(before["sim-only"]) + 1) as pool:
        kills = [
            pool.submit(kill_replica, APP, f"backend-{backend}", r)
            for backend, replicas in before.items()
            for r in replicas
        ]
        for k in kills:
            k.result()
    all_killed_at = time.monotonic()
    # Serve replaces them: new replica ids serving, then a few more requests on them.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        now = {b: _replicas(nocap, b) for b in before}
        if all(len(now[b]) == len(before[b]) and not set(now[b]) & set(before[b]) for b in before):
            break
        time.sleep(0.5)
    replaced_at = time.monotonic()
    time.sleep(2.0)
    only.finish()
    mixed.finish()

    def codes(load: _Load, start: float, end: float) -> Counter[tuple[int, str]]:
        return Counter((s, c) for t, s, c, *_ in load.seen if start <= t < end)

    print(
        "only-sim before/outage/after:",
        codes(only, 0, killed_at),
        codes(only, killed_at, replaced_at),
        codes(only, replaced_at + 1.0, float("inf")),
    )
    # Before the kills: every request that had ended by then was served. (One sent just before them
    # may still wait for a replica as they die, and get the outage's 503: a CI run at 7ab7e4d.)
    ended_before = {(s, c) for t, s, c, _, _, took in only.seen if t + took < killed_at}
    assert ended_before == {(200, "")}, Counter((s, c) for t, s, c, *_ in only.seen if t < killed_at)

    # A request already running on a replica as it was killed broke mid-answer (a sim-first stream
    # has no other replica to continue on): a clean 502 stream_interrupted, never before a token.
    def at_kill(x: tuple) -> bool:  # sent before the last kill, still running at the first
        return x[0] < all_killed_at and x[0] + x[5] >= killed_at

    during = {(x[1], x[2]) for x in [*only.seen, *mixed.seen] if at_kill(x)}
    assert during <= {(200, ""), (503, "no_capacity"), (502, "stream_interrupted")}, during
    outage = [x for x in only.seen if all_killed_at <= x[0] < replaced_at]
    assert outage, "no request was sent while the replicas were down"
    assert {(s, c) for _, s, c, *_ in outage} <= {(200, ""), (503, "no_capacity")}, Counter(
        (s, c) for _, s, c, *_ in outage
    )  # never a 502 from a dead replica
    for _, status, _, retry_after, _, _ in outage:
        if status == 503:
            assert retry_after is not None and int(retry_after) >= 1
    # the outage was felt: a 503 after waiting its queue deadline, or a request that waited for the
    # replacement (a sim replica can come back within 0.25 s: two CI runs saw the first request
    # after the kills take 0.22-0.24 s, every other one 0.02-0.03 s)
    assert any(s == 503 or took > 0.15 for _, s, _, _, _, took in outage), outage
    assert set(codes(only, replaced_at + 1.0, float("inf"))) == {(200, "")}
    # The route with a provider: served all along, by the provider while its sim replica was down.
    after_kill = [x for x in mixed.seen if not at_kill(x)]
    assert {s for _, s, *_ in after_kill} == {200}, Counter((s, c) for _, s, c, *_ in mixed.seen)
    by_provider = [x for x in mixed.seen if all_killed_at <= x[0] < replaced_at and x[4] == "prov-after"]
    assert by_provider and min(x[5] for x in by_provider) < 1.0  # at once, not after the queue wait
