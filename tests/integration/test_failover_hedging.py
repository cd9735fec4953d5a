"""Issue 6 on a local Ray Serve: provider backends (loopback servers speaking the real wire formats,
with fault modes) in front of simulated engines. Failover before the first token, hedging with
the loser aborted upstream, a replica killed mid-stream, context-window routing, and the breakers."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter

import httpx
import pytest
from openai import APIError, OpenAI

from cluster.config import parse_config
from cluster.observability.server_timing import parse_server_timing
from deployments.internal import debug_ids_headers
from fixtures.replicas import kill_replica
from fixtures.servers.anthropic_server import AnthropicServer
from fixtures.servers.openai_server import OpenAIServer
from loadtest.common.reliability import provider_backend
from tests.streamread import take_data_line

pytestmark = pytest.mark.integration

KEY = "sk-test-failover-0123456789"
KEY_ENV = "LLMC_TEST_PROVIDER_KEY"


@pytest.fixture(scope="module")
def servers():
    with (
        OpenAIServer(api_key=KEY, output_tokens=12) as oai,
        AnthropicServer(api_key=KEY, output_tokens=12) as ant,
    ):
        yield oai, ant


_provider = functools.partial(  # (name, api, url, model)
    provider_backend,
    key_env=KEY_ENV,
    env={KEY_ENV: KEY},
    first_token_timeout_s=1.5,
    between_tokens_timeout_s=5,
    total_timeout_s=30,
    cost_per_mtok_input=0.15,
    cost_per_mtok_output=0.6,
)


def _sim(name: str, model: str, replicas: int = 1) -> dict:
    return {
        "name": name,
        "kind": "sim",
        "model": model,
        "replicas": replicas,
        "resources": {"num_cpus": 0.1},
        "sim_profile": "llama-3.1-8b-h100",
    }


@pytest.fixture(scope="module")
def mix(deploy, servers):
    oai, ant = servers
    tiny = {"tokenizer": "@tiny", "default_max_tokens": 16}
    cfg = parse_config(
        {
            "name": "llm-cluster-mix",
            "server": {"gateway_replicas": 1},  # the policy counters read below are one gateway's
            "models": [
                {"name": "mix", "context_window": 4096, **tiny},
                {"name": "claude-mix", "context_window": 4096, **tiny},
                {"name": "solo", "context_window": 8192, **tiny},
                {"name": "small", "context_window": 256, "overflow_to": "big", **tiny},
                {"name": "big", "context_window": 8192, **tiny},
                {"name": "small-only", "context_window": 256, **tiny},
            ],
            "backends": [
                _provider("prov-openai", "openai", oai.base_url, "mix"),
                _sim("sim-mix", "mix"),
                _provider(
                    "prov-anthropic", "anthropic", ant.base_url.removesuffix("/v1") + "/v1", "claude-mix"
                ),
                _sim("sim-solo", "solo", replicas=2),
                _sim("sim-small", "small"),
                _sim("sim-big", "big"),
                _sim("sim-small-only", "small-only"),
            ],
            "surfaces": [
                {"name": "chat", "priority": 1},
                {"name": "tab", "priority": 0, "hedging": True},
            ],
            "routes": [{"model": "mix", "candidates": ["prov-openai", "sim-mix"]}],
            "policies": {
                "hedging": {"quantile": None, "fixed_delay_s": 0.3, "budget_ratio": 0.25, "budget_burst": 1},
                "failover": {"breaker": {"consecutive_failures": 1, "base_ejection_s": 1.0}},
                # The hedge's delay and budget alone: with brownout on, the provider slowed here would
                # be demoted after a few slow first tokens and the hedge delay capped at its slow
                # threshold (tests/unit/test_brownout.py and the rehearsal cover those).
                "brownout": {"enabled": False},
            },
        }
    )
    return deploy(cfg, route_prefix="/mix")


def _chat(mix, model: str, content: str = "hi", surface: str = "chat", **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(
        mix.base_url + "/chat/completions", json=body, headers={"x-surface": surface}, timeout=60
    )


def test_provider_serves_when_healthy_and_counts_cost(mix, servers) -> None:
    oai, _ = servers
    before = oai.stats().requests
    r = _chat(mix, "mix")
    assert r.status_code == 200, r.text
    assert r.headers["x-llmc-backend"] == "prov-openai"
    assert r.json()["usage"]["completion_tokens"] == 12
    assert oai.stats().requests == before + 1


@pytest.mark.parametrize("fault", ["500", "429:2", "529", "hang"])
def test_provider_fault_fails_over_to_the_next_candidate(mix, servers, fault: str) -> None:
    oai, _ = servers
    if fault == "529":
        fault = "503"  # OpenAI-style servers have no 529; Anthropic's is tested below
    snap0 = mix.status()["policy"]
    oai.push_faults(fault)
    client = OpenAI(base_url=mix.base_url, api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="mix", messages=[{"role": "user", "content": "x"}], max_tokens=6, stream=True
        )
    )
    # One clean stream from the sim, ending with a finish reason.
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    snap = mix.status()["policy"]
    assert snap["failovers"].get("prov-openai", 0) == snap0["failovers"].get("prov-openai", 0) + 1
    # The provider comes back once its breaker's ejection (1 s, doubling with repeats) is over.
    assert _until_served_by(mix, "mix", "prov-openai", timeout=15)


def _until_served_by(mix, model: str, backend: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _chat(mix, model).headers.get("x-llmc-backend") == backend:
            return True
        time.sleep(0.25)
    return False


def test_anthropic_provider_through_the_cluster(mix, servers) -> None:
    _, ant = servers
    client = OpenAI(base_url=mix.base_url, api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="claude-mix",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12
    assert ant.stats().records[-1].model == "claude-sonnet-4-5"


def test_anthropic_529_with_no_alternative_is_a_clean_error(mix, servers) -> None:
    _, ant = servers
    ant.push_faults("529")
    r = _chat(mix, "claude-mix")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "overloaded"
    assert _until_served_by(mix, "claude-mix", "prov-anthropic", timeout=15)


def test_slow_first_token_is_hedged_and_the_loser_aborted(mix, servers) -> None:
    oai, _ = servers
    assert _until_served_by(mix, "mix", "prov-openai", timeout=15)  # earlier faults have healed
    # Fund the hedge budget (0.25 per request, burst 1) with healthy tab requests first.
    for _ in range(4):
        plain = _chat(mix, "mix", surface="tab")
        assert plain.status_code == 200
    timing = parse_server_timing(plain.headers["server-timing"])
    assert set(timing) == {"prep", "queue", "upstream", "ttft"}, plain.headers["server-timing"]
    assert 0 < timing["upstream"] <= timing["ttft"] and timing["prep"] <= timing["ttft"]
    snap0 = mix.status()["policy"]
    disconnects0 = oai.stats().disconnects
    oai.push_faults("slow_first:5")
    t0 = time.monotonic()
    r = _chat(mix, "mix", surface="tab", max_tokens=5)
    assert r.status_code == 200, r.text
    assert r.headers["x-llmc-backend"] == "sim-mix"  # the hedge won
    assert (r.headers["x-llmc-attempts"], r.headers["x-llmc-hedge-won"]) == ("2", "1")
    assert time.monotonic() - t0 < 4  # well before the slow provider's first token (5 s)
    # Server-Timing's upstream is the winner's own time: the hedge delay (0.3 s) is the gateway's
    timing = parse_server_timing(r.headers["server-timing"])
    assert timing["ttft"] - timing["prep"] - timing["queue"] - timing["upstream"] >= 299, timing
    snap = mix.status()["policy"]
    assert snap["hedges_won"] == snap0["hedges_won"] + 1
    # The loser's cancel reached the provider: it saw the client go away.
    deadline = time.monotonic() + 3
    while oai.stats().disconnects == disconnects0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert oai.stats().disconnects == disconnects0 + 1


def test_hedges_stay_within_the_budget(mix, servers) -> None:
    oai, _ = servers
    snap0 = mix.status()["policy"]
    n = 8
    oai.push_faults(*["slow_first:1"] * n)
    for _ in range(n):
        assert _chat(mix, "mix", surface="tab", max_tokens=3).status_code == 200
    snap = mix.status()["policy"]
    sent = snap["hedges_sent"] - snap0["hedges_sent"]
    requests = snap["requests"] - snap0["requests"]
    assert requests == n
    # Each request earns 0.25 of a hedge (saved up to the burst, 1) and every first token here is
    # slower than the hedge delay: exactly the hedges the bucket paid for, no fewer, no more.
    tokens, want = snap0["hedge_tokens"], 0
    for _ in range(n):
        tokens = min(1.0, tokens + 0.25)
        if tokens >= 1.0:
            tokens, want = tokens - 1.0, want + 1
    assert sent == want and want >= 2, (sent, want, snap0["hedge_tokens"])
    assert snap["hedge_tokens"] == pytest.approx(tokens)
    assert snap["hedges_sent"] <= 0.25 * snap["requests"] + 1


async def _solo_stream(c: httpx.AsyncClient, mix, i: int, seen: dict[int, dict]) -> dict:
    """One seeded stream on solo, read raw (``seen[i]`` fills as it goes): its replica, token ids
    (the engine's ``: ids`` comment lines, which SSE clients skip), text, role deltas, finish
    reasons, usage, and the error event if one came."""
    body = {
        "model": "solo",
        "messages": [{"role": "user", "content": f"plan number {i} " * (i + 1)}],
        "max_tokens": 600,
        "seed": 1000 + i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict = {"ids": [], "text": [], "roles": 0, "finish": [], "usage": None, "error": None}
    headers = debug_ids_headers()  # each event's token ids, which clients never see
    async with c.stream("POST", mix.base_url + "/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        out["replica"] = r.headers["x-llmc-replica"]
        seen[i] = out
        async for line in r.aiter_lines():
            if line.startswith(": ids "):
                out["ids"] += [int(t) for t in line[6:].split(",")]
            elif line.startswith("data: {"):
                take_data_line(out, line)
    return out


def _solo_replicas(stats: dict) -> list[str]:
    return [r for r, s in stats.items() if s.backend == "sim-solo"]


async def test_replica_killed_mid_stream_under_load_the_streams_go_on_elsewhere(mix) -> None:
    """Issue 19: eight seeded streams, then the same eight again with the replica that holds
    most of them killed mid-stream. Every stream completes, and each one's tokens, text, finish
    and usage equal its own run without the fault: no token lost or repeated at the seam, one
    role delta, one finish_reason, the usage counting each token once."""
    n, ref_seen, seen = 8, {}, {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, read=60)) as c:
        ref = await asyncio.gather(*(_solo_stream(c, mix, i, ref_seen) for i in range(n)))
        snap0 = mix.status()["policy"]
        tasks = [asyncio.create_task(_solo_stream(c, mix, i, seen)) for i in range(n)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            len(seen) < n or min(len(o["ids"]) for o in seen.values()) < 5
        ):
            await asyncio.sleep(0.02)
        assert len(seen) == n and max(len(o["ids"]) for o in seen.values()) < 600  # all mid-stream
        on = Counter(o["replica"] for o in seen.values())
        victim = on.most_common(1)[0][0]
        await asyncio.to_thread(kill_replica, mix.cfg.name, "backend-sim-solo", victim)
        got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert b["error"] is None, (i, b["error"])
        assert len(b["ids"]) == 600 and b["ids"] == a["ids"], i  # nothing lost, nothing repeated
        assert "".join(b["text"]) == "".join(a["text"]), i
        assert b["roles"] == 1 and b["finish"] == ["length"], (i, b["roles"], b["finish"])
        assert b["usage"]["completion_tokens"] == 600 and b["usage"] == a["usage"] | {
            "prompt_tokens_details": b["usage"]["prompt_tokens_details"]
        }, (i, a["usage"], b["usage"])
    moved = sum(1 for o in got if o["replica"] == victim)
    assert moved == on[victim] >= 1
    snap = mix.status()["policy"]
    migrated = snap["migrations"].get("death:migrated", 0) - snap0["migrations"].get("death:migrated", 0)
    assert migrated == moved, snap["migrations"]


def test_replica_killed_mid_stream_ends_with_an_error_event(mix) -> None:
    """Where migration is refused (here: a stop string, whose text the engine may hold back at the
    seam), a stream whose replica dies still ends with one clean error event."""
    client = OpenAI(base_url=mix.base_url, api_key="x", max_retries=0)
    mix.wait_stats(lambda s: len(_solo_replicas(s)) == 2, timeout=60)  # the kill above is repaired
    snap0 = mix.status()["policy"]
    raw = client.chat.completions.with_raw_response.create(
        model="solo",
        messages=[{"role": "user", "content": "long"}],
        max_tokens=4000,
        stream=True,
        stop=["never-said"],
        extra_body={"ignore_eos": True},
    )
    replica = raw.headers["x-llmc-replica"]
    stream = raw.parse()
    got = 0
    with pytest.raises(APIError) as info:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
            if got == 5:
                kill_replica(mix.cfg.name, "backend-sim-solo", replica)
    assert 5 <= got < 4000
    assert "stream" in str(info.value).lower()
    # New requests go elsewhere, and the dead replica's breaker opened.
    r = _chat(mix, "solo", max_tokens=3)
    assert r.status_code == 200 and r.headers["x-llmc-replica"] != replica
    snap = mix.status()["policy"]
    assert snap["broken_streams"].get("sim-solo", 0) >= 1
    refused = snap["migrations"].get("death:stop_strings", 0) - snap0["migrations"].get(
        "death:stop_strings", 0
    )
    assert refused == 1, snap["migrations"]
    states = {(b["backend"], b["replica"]): b["state"] for b in snap["breakers"]}
    live = mix.status()["routing"]["sim-solo"]["replicas"]
    # Not routable: its breaker is open (or half-open), or Serve already dropped it from the view
    # (its breaker goes with it). A closed breaker on a live dead replica fails this.
    if replica in live:
        assert states.get(("sim-solo", replica)) in (1, 2), (states, live)
    else:
        assert ("sim-solo", replica) not in states, states
    # ... and the backend's breaker closes again once a request succeeds after its ejection (1 s,
    # doubled for each failure in a row: a request sent to the dead replica before Serve dropped it
    # counts too, so the ejection may be 2 or 4 s here). Every request meanwhile is answered.
    deadline = time.monotonic() + 15
    while True:
        time.sleep(0.5)
        assert _chat(mix, "solo", max_tokens=3).status_code == 200
        snap = mix.status()["policy"]
        states = {(b["backend"], b["replica"]): b["state"] for b in snap["breakers"]}
        if states[("sim-solo", "")] == 0 or time.monotonic() > deadline:
            break
    assert states[("sim-solo", "")] == 0, snap


def test_oversized_prompt_goes_to_the_bigger_model(mix) -> None:
    stats0 = {s.backend: s.requests_started for s in mix.replica_stats().values()}
    long_text = "word " * 400  # ~400 tokens: over small's 256 window
    r = _chat(mix, "small", content=long_text, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "big"
    assert r.headers["x-llmc-backend"] == "sim-big"
    stats = mix.wait_stats(
        lambda s: any(
            x.backend == "sim-big" and x.requests_started > stats0.get("sim-big", 0) for x in s.values()
        )
    )
    started = {s.backend: s.requests_started for s in stats.values()}
    assert started.get("sim-small", 0) == stats0.get("sim-small", 0)  # never sent, never truncated


def test_oversized_prompt_without_overflow_is_a_400_with_both_counts(mix) -> None:
    r = _chat(mix, "small-only", content="word " * 400, max_tokens=8)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "256 tokens" in err["message"] and "8 in the completion" in err["message"]


def test_client_disconnect_closes_the_provider_stream(mix, servers) -> None:
    oai, _ = servers
    d0 = oai.stats().disconnects
    oai.push_faults("delay:0.2")  # 0.2 s between tokens: time to leave mid-stream
    body = {"model": "mix", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 12}
    with httpx.Client(timeout=30) as c, c.stream("POST", mix.base_url + "/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 3
    while oai.stats().disconnects == d0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert oai.stats().disconnects == d0 + 1
