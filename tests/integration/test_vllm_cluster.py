"""The local cluster's vLLM-CPU replicas: cancellation reaches the engine, prefix caching works."""

from __future__ import annotations

import time

import httpx
import pytest

from cluster.tokens import load_tokenizer

pytestmark = pytest.mark.integration


def _totals(stats: dict) -> dict[str, int]:
    return {
        "aborted": sum(s.requests_aborted for s in stats.values()),
        "finished": sum(s.requests_finished for s in stats.values()),
        "running": sum(s.running + s.waiting for s in stats.values()),
        "unfinished": sum(s.extra.get("unfinished", 0) for s in stats.values()),
    }


def test_client_disconnect_aborts_the_engine_request(cluster) -> None:
    # Start from a quiet cluster: earlier requests finished and reported.
    before = _totals(cluster.wait_stats(lambda s: len(s) == 2 and _totals(s)["unfinished"] == 0))
    time.sleep(0.5)
    before = _totals(cluster.replica_stats())
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "count to a million"}],
        "max_tokens": 1900,
        "stream": True,
        "ignore_eos": True,
    }
    received = 0
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", cluster.base_url + "/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received >= 5:
                break  # leaving the block closes the connection mid-stream
    # The engine request is aborted: counted as aborted, nothing left running or unfinished,
    # and the stream was nowhere near its 1900 tokens.
    after = _totals(
        cluster.wait_stats(
            lambda s: _totals(s)["aborted"] > before["aborted"] and _totals(s)["unfinished"] == 0, timeout=15
        )
    )
    assert after["aborted"] == before["aborted"] + 1
    assert after["finished"] == before["finished"]
    assert after["unfinished"] == 0 and after["running"] == 0


def test_shared_prefix_hits_the_prefix_cache(cluster) -> None:
    prefix = " ".join(f"def function_{i}(x): return x * {i}" for i in range(60))  # ~1000 tokens
    stats0 = cluster.wait_stats(lambda s: len(s) == 2)
    hits0 = {rid: s.prefix_cache_hits for rid, s in stats0.items()}
    for question in ("What does function_3 do?", "What does function_7 do?"):
        r = httpx.post(
            cluster.base_url + "/chat/completions",
            json={
                "model": "tiny-llama",
                "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        time.sleep(0.1)
    usage = r.json()["usage"]
    # The second request found the shared prefix in vLLM's cache: all whole 32-token blocks of it.
    tok = load_tokenizer("@tiny")
    a = tok.chat_ids(
        [{"role": "system", "content": prefix}, {"role": "user", "content": "What does function_3 do?"}]
    )
    b = tok.chat_ids(
        [{"role": "system", "content": prefix}, {"role": "user", "content": "What does function_7 do?"}]
    )
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > 500
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == common // 32 * 32
    stats = cluster.wait_stats(lambda s: sum(x.prefix_cache_hits for x in s.values()) > sum(hits0.values()))
    gained = {rid: s.prefix_cache_hits - hits0.get(rid, 0) for rid, s in stats.items()}
    assert max(gained.values()) >= cached
