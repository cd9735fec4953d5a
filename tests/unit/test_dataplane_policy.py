"""The data plane's pure pieces: the engine wire's framing, the routing view, the attempt rules."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cluster.config import BackendConfig, load_config
from cluster.policy.attempts import avoid_replicas, effects, expand_slots
from cluster.policy.failover import ReplicaEjector
from cluster.routing.affinity import AffinityParams, AffinityRouter
from cluster.routing.view import BackendView, ReplicaInfo
from cluster.wire.engine_stream import (
    FrameSplitter,
    end_frame,
    error_frame,
    parse_request,
    request_body,
)
from cluster.wire.errors import BackendUnavailable, InvalidRequest, StreamInterrupted
from cluster.wire.openai_format import ResponseMeta, sse, stream_chunk
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, Sampling, Usage

META = ResponseMeta(kind="chat", request_id="r1", model="m", created=1)


def test_frames_pass_through_whole_events_and_the_end_frame_is_split_off() -> None:
    events = b"".join(sse(stream_chunk(META, t, None, first=i == 0)) for i, t in enumerate(["a", "b"]))
    wire = events + end_frame("length", Usage(3, 2, 1), replica="x")
    s = FrameSplitter()
    out = b""
    for i in range(0, len(wire), 7):  # arbitrary network reads
        out += s.feed(wire[i : i + 7])
    assert out == events  # byte for byte, nothing re-encoded
    assert s.end is not None and s.end.finish_reason == "length" and s.end.usage == Usage(3, 2, 1)


def test_generated_text_that_looks_like_a_control_frame_is_content() -> None:
    tricky = sse(stream_chunk(META, "\n: llmc end {}\n\n", None))  # JSON escapes the newlines
    s = FrameSplitter()
    assert s.feed(tricky) == tricky and s.end is None


def test_a_typed_error_crosses_the_wire() -> None:
    s = FrameSplitter()
    s.feed(error_frame(StreamInterrupted("engine died", backend="b")))
    assert s.end is not None and isinstance(s.end.error, StreamInterrupted)
    assert s.end.error.backend == "b" and s.end.error.message == "engine died"


def test_the_internal_request_round_trips() -> None:
    req = GenerateRequest(
        "r1", "m", "chat", [1, 2, 3], Sampling(max_tokens=5, seed=7), surface="tab", priority=0
    )
    back, meta, collect = parse_request(request_body(req, META, True))
    assert back == req and meta == META and collect
    agent = GenerateRequest("r2", "m", "chat", [1], Sampling(max_tokens=1), surface="agent", priority=2)
    assert parse_request(request_body(agent, META, False))[0].priority == 2  # the surface part of the key


def _view(n_blocks_capacity: int = 1000) -> BackendView:
    policy = AffinityRouter(4, "m", AffinityParams(min_match_tokens=4))
    return BackendView("b", policy, ReplicaEjector(), 8)


def test_the_view_follows_serves_replica_list() -> None:
    v = _view()
    v.sync([ReplicaInfo("r1", "http://a"), ReplicaInfo("r2", "http://b"), ReplicaInfo("r3", None)])
    assert set(v.live) == {"r1", "r2"}  # no endpoint published yet: not routable
    c = v.choose([1, 2], 0.0)
    assert c is not None
    v.started(c, [1, 2], 0.0, None)
    assert v.snapshot().in_flight[c.replica] == 1
    v.sync([ReplicaInfo("r2", "http://b")] if c.replica == "r1" else [ReplicaInfo("r1", "http://a")])
    assert c.replica not in v.live and c.replica not in v.snapshot().in_flight  # gone everywhere at once


def test_the_view_prefers_the_prefix_holder_and_avoids_earlier_replicas() -> None:
    v = _view()
    v.sync([ReplicaInfo("r1", "http://a"), ReplicaInfo("r2", "http://b")])
    hashes = v.policy.hash(list(range(16)))  # type: ignore[union-attr]
    first = v.choose(hashes, 0.0)
    assert first is not None
    v.started(first, hashes, 0.0, None)
    again = v.choose(hashes, 0.0)
    assert again is not None and again.replica == first.replica and again.decision.reason == "prefix"
    other = v.choose(hashes, 0.0, avoid=[first.replica])
    assert other is not None and other.replica != first.replica


def test_a_latency_bound_request_skips_a_replica_prefilling_a_long_prompt() -> None:
    v = _view()
    v.sync([ReplicaInfo("r1", "http://a"), ReplicaInfo("r2", "http://b")])
    tab = v.policy.hash(list(range(16)))  # type: ignore[union-attr]
    home = v.choose(tab, 0.0, session_id="tab-1")
    assert home is not None
    v.started(home, tab, 0.0, "tab-1", prompt_tokens=16)
    v.prefilled(home)  # its first token: nothing of it left prefilling
    v.ended(home.replica, home)
    agent = v.policy.hash(list(range(1000, 1000 + 4 * 300)))  # type: ignore[union-attr]
    long = v.choose(agent, 0.0, avoid=[r for r in v.live if r != home.replica])  # on Tab's replica
    assert long is not None and long.replica == home.replica and long.decision.matched_blocks == 0
    v.started(long, agent, 0.0, None, prompt_tokens=1200)
    assert v.snapshot().prefilling[home.replica] == 1200 and long.prefill_tokens == 1200
    # The session's replica is prefilling 1,200 uncached tokens: Tab goes to the other one ...
    moved = v.choose(tab, 0.0, session_id="tab-1", busy_prefill_tokens=512)
    assert moved is not None and moved.replica != home.replica and v.snapshot().avoided_prefill == 1
    # ... without the threshold, or above what is prefilling, it stays with its session and cache
    for busy in (None, 2000):
        stay = v.choose(tab, 0.0, session_id="tab-1", busy_prefill_tokens=busy)
        assert stay is not None and stay.replica == home.replica
    v.prefilled(long)  # Agent's first token: its prefill is over
    assert home.replica not in v.snapshot().prefilling and long.prefill_tokens == 0
    back = v.choose(tab, 0.0, session_id="tab-1", busy_prefill_tokens=512)
    assert back is not None and back.replica == home.replica and v.snapshot().avoided_prefill == 1
    v.ended(long.replica, long)  # counted once, whatever comes after the first token
    s = v.snapshot()
    assert home.replica not in s.prefilling and s.in_flight.get(home.replica, 0) == 0


def test_prefill_avoidance_never_leaves_a_request_without_a_replica() -> None:
    v = _view()
    v.sync([ReplicaInfo("r1", "http://a"), ReplicaInfo("r2", "http://b")])
    agent = [v.policy.hash(list(range(k, k + 1200))) for k in (10_000, 20_000)]  # type: ignore[union-attr]
    for i, hashes in enumerate(agent):
        c = v.choose(hashes, 0.0, avoid=[["r2"], ["r1"]][i])
        assert c is not None
        v.started(c, hashes, 0.0, None, prompt_tokens=1200)
    assert v.snapshot().prefilling == {"r1": 1200, "r2": 1200}
    tab = v.choose(v.policy.hash(list(range(16))), 0.0, busy_prefill_tokens=512)  # type: ignore[union-attr]
    assert tab is not None and v.snapshot().avoided_prefill == 0  # both busy: chosen as without the threshold
    cached = v.choose(agent[0], 0.0)
    assert cached is not None and cached.decision.matched_blocks > 0
    v.started(cached, agent[0], 0.0, None, prompt_tokens=1200)
    assert cached.prefill_tokens < 1200  # what the decision expects cached does not count
    v.sync([ReplicaInfo("r2", "http://b")])
    assert "r1" not in v.snapshot().prefilling  # a replica gone is forgotten here too


def test_the_views_choice_carries_the_attempts_cache_rank() -> None:
    v = _view()
    v.sync([ReplicaInfo("r1", "http://a"), ReplicaInfo("r2", "http://b")])
    hashes = v.policy.hash(list(range(16)))  # type: ignore[union-attr]
    first = v.choose(hashes, 0.0)
    assert first is not None and first.cache_rank == 1  # nothing cached yet
    v.started(first, hashes, 0.0, None)
    again = v.choose(hashes, 0.0)
    assert again is not None and again.replica == first.replica and again.cache_rank == 0
    elsewhere = v.choose(hashes, 0.0, avoid=[first.replica])
    assert elsewhere is not None and elsewhere.cache_rank == 1
    by_load = BackendView("b", v.policy, ReplicaEjector(), 8, mode="least_loaded")
    by_load.sync([ReplicaInfo("r1", "http://a")])
    assert by_load.choose(hashes, 0.0).cache_rank == 0  # type: ignore[union-attr]  # no ranking


def test_the_engine_queues_by_surface_then_cache_rank() -> None:
    def key(priority: int, rank: int) -> int:
        req = GenerateRequest(
            "r", "m", "chat", [1], Sampling(max_tokens=1), priority=priority, cache_rank=rank
        )
        back = parse_request(request_body(req, META, False))[0]
        assert back.cache_rank == rank  # it reaches the engine replica
        return back.engine_priority

    assert (
        key(0, 0) < key(0, 1) < key(1, 0) < key(1, 1) < key(2, 0) < key(2, 1)
    )  # Tab's miss before Chat's hit


def test_slots_and_the_avoid_set() -> None:
    backends = {
        "vllm": BackendConfig.model_validate({"name": "vllm", "kind": "sim", "model": "m", "replicas": 2}),
        "one": BackendConfig.model_validate({"name": "one", "kind": "sim", "model": "m", "replicas": 1}),
    }
    assert expand_slots(["vllm", "one"], backends.__getitem__) == ["vllm", "vllm#2", "one"]
    assert avoid_replicas("vllm", [("vllm", "r1"), ("vllm#2", "r2"), ("one", "r3"), ("vllm", None)]) == [
        "r1",
        "r2",
    ]


def test_verdict_effects() -> None:
    won = effects("won", None, hedge=True)
    assert won.breaker is True and won.observe_ttft and won.hedge_won is True
    assert effects("broken", None, False).breaker is False and effects("broken", None, False).broken
    down = effects("failed", BackendUnavailable("x"), False)
    assert down.breaker is False and down.failover
    client = effects("failed", InvalidRequest("bad"), False)
    assert client.breaker is None and client.failover  # a client error is not the backend's fault
    lost = effects("cancelled", None, hedge=True)
    assert lost.breaker is None and lost.observe_ttft and lost.hedge_won is False


def test_power_of_two_picks_the_less_loaded_of_two() -> None:
    v = BackendView("b", None, ReplicaEjector(), 8, mode="power_of_two")
    v.sync([ReplicaInfo("r1", "http://a", waiting=5), ReplicaInfo("r2", "http://b", waiting=0)])
    chosen = {v.choose([], 0.0).replica for _ in range(20)}  # type: ignore[union-attr]
    assert chosen == {"r2"}  # with two replicas both are drawn: the less loaded wins every time


@pytest.mark.parametrize(("surface", "priority"), [("tab", 0), ("chat", 1), ("agent", 2)])
def test_a_request_carries_its_surfaces_priority(surface: str, priority: int) -> None:
    from deployments.gateway.prepare import prepare

    cfg = load_config(Path(__file__).parents[2] / "configs" / "sim-local.yaml")
    body = json.dumps({"model": "sim-llama-8b", "messages": [{"role": "user", "content": "hi"}]}).encode()
    p = prepare(cfg, body, ChatCompletionRequest, "chat", "r1", surface, None, {})
    assert p.req.priority == priority


def _ticks_during_prepare(content: str) -> tuple[int, int]:
    """How often a task on the loop ran while the request was prepared, and the prompt's tokens."""
    from deployments.gateway.prepare import prepare_off_loop

    cfg = load_config(Path(__file__).parents[2] / "configs" / "sim-local.yaml")
    cfg.models[0] = cfg.models[0].model_copy(update={"context_window": 400_000})  # the big body fits
    body = json.dumps({"model": "sim-llama-8b", "messages": [{"role": "user", "content": content}]}).encode()

    async def main() -> tuple[int, int]:
        ticks, done = 0, False
        await prepare_off_loop(
            cfg,
            b'{"model": "sim-llama-8b", "prompt": "warm"}',
            CompletionRequest,
            "completion",
            "w",
            "chat",
            None,
            {},
        )

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.001)  # not 0: a spinning loop would starve the worker thread

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker's first step
        ticks = 0
        p = await prepare_off_loop(cfg, body, ChatCompletionRequest, "chat", "r1", "chat", None, {})
        done = True
        await t
        return ticks, len(p.req.prompt_token_ids or [])

    return asyncio.run(main())


def test_a_big_body_is_prepared_while_the_loop_serves_the_other_streams() -> None:
    """Issue 15 item 9: validating and tokenizing a body near the size limit on the event loop
    stalled every stream the gateway relays (an 82 KB body, 32.8k tokens: 55-61 ms here, measured
    2026-12-01). Structural, not timed: prepared on the loop, the ticker cannot run until it is
    done; in a worker thread it runs meanwhile."""
    from deployments.gateway.prepare import INLINE_PREPARE_BYTES

    ticks, tokens = _ticks_during_prepare("word " * (INLINE_PREPARE_BYTES // 4))
    assert tokens > 1000 and ticks > 0
    ticks, tokens = _ticks_during_prepare("hi")  # a small one stays on the loop: no thread hop
    assert tokens > 0 and ticks == 0
