"""Mid-stream migration's pure rules (cluster/policy/migration.py) and the token ids on the engine wire
(cluster/wire/engine_stream.py): when a broken stream may continue elsewhere, what the continuation is,
and what the client's usage says."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.policy.migration import (
    Break,
    MigrationConfig,
    MigrationPolicy,
    classify,
    client_usage,
    continuation,
)
from cluster.wire.engine_stream import FrameSplitter, event_with_ids, parse_emitted, parse_flags, request_body
from cluster.wire.errors import StreamInterrupted, UpstreamTimeout
from cluster.wire.openai_format import ResponseMeta, sse, stream_chunk
from cluster.wire.protocol import GenerateRequest, Sampling, Usage

META = ResponseMeta(kind="chat", request_id="r1", model="m", created=1)


def req(**sampling: object) -> GenerateRequest:
    s = Sampling(max_tokens=sampling.pop("max_tokens", 100), **sampling)  # type: ignore[arg-type]
    return GenerateRequest("r1", "m", "chat", [1, 2, 3], s)


def brk(**kw: object) -> Break:
    base: dict[str, object] = {
        "reason": "death",
        "backend_kind": "sim",
        "migrations": 0,
        "tokens_known": True,
        "time_left_s": None,
    }
    return Break(**{**base, **kw})  # type: ignore[arg-type]


def test_a_broken_self_hosted_stream_migrates() -> None:
    d = MigrationPolicy().decide(req(), brk(), now=0.0)
    assert d.allowed and d.why == "migrate"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"backend_kind": "provider"}, "provider"),
        ({"migrations": 2}, "max_per_request"),
        ({"tokens_known": False}, "tokens_unknown"),
        ({"time_left_s": 0.1}, "deadline"),
    ],
)
def test_what_never_migrates(change: dict[str, object], why: str) -> None:
    d = MigrationPolicy().decide(req(), brk(**change), now=0.0)
    assert not d.allowed and d.why == why


def test_stop_strings_penalties_reasons_and_the_switch() -> None:
    p = MigrationPolicy()
    assert p.decide(req(stop=["\n"]), brk(), 0.0).why == "stop_strings"
    assert p.decide(req(presence_penalty=0.5), brk(), 0.0).why == "penalties"
    only_death = MigrationPolicy(MigrationConfig(reasons=["death"]))
    assert only_death.decide(req(), brk(reason="stall"), 0.0).why == "reason"
    assert only_death.decide(req(), brk(reason="death"), 0.0).allowed
    assert MigrationPolicy(MigrationConfig(enabled=False)).decide(req(), brk(), 0.0).why == "disabled"
    with pytest.raises(ValidationError, match="reasons"):
        MigrationConfig(reasons=["crash"])  # type: ignore[list-item]


def test_structured_decoding_and_tool_calls_never_migrate() -> None:
    """A continuation would restart the grammar from its first token, and another replica's parser
    would not know the calls already sent: response_format, forced and parsed tool calls end the
    stream as before. (Breaking the rule makes every assertion here fail.)"""
    p = MigrationPolicy()
    assert p.decide(req(structured={"json": {"type": "object"}}), brk(), 0.0).why == "structured"
    assert p.decide(req(structured={"json_object": True}), brk(), 0.0).why == "structured"
    tools = GenerateRequest("r1", "m", "chat", [1], Sampling(max_tokens=9), tool_parse={"mode": "hermes"})
    assert p.decide(tools, brk(), 0.0).why == "tools"
    assert p.decide(req(), brk(), 0.0).allowed  # the same request without either migrates
    assert p.decide(req(n=2), brk(), 0.0).why == "n"  # its choices interleave in one stream


def test_the_budget_is_a_share_of_requests_over_the_window() -> None:
    p = MigrationPolicy(MigrationConfig(ratio=0.1, min_per_s=0.0, window_s=10.0))
    for _ in range(20):
        p.on_request(1.0)
    assert [p.decide(req(), brk(), 1.0).allowed for _ in range(3)] == [True, True, False]
    assert p.decide(req(), brk(), 1.0).why == "budget"
    assert p.decide(req(), brk(), 30.0).why == "budget"  # the window forgot the requests too
    p.on_request(30.0)
    p.on_request(30.0)
    assert p.available(30.0) == pytest.approx(0.2)


def test_a_stall_is_told_from_a_death_by_its_cause() -> None:
    stalled = StreamInterrupted("silent")
    stalled.__cause__ = UpstreamTimeout("went silent")
    assert classify(None, stalled) == "stall"
    assert classify("death", StreamInterrupted("x")) == "death"
    assert classify("drain", StreamInterrupted("x")) == "drain"
    assert classify(None, StreamInterrupted("engine said so")) == "error"


def test_the_continuation_appends_the_tokens_sent_and_keeps_the_sampling() -> None:
    r = req(max_tokens=10, seed=7, temperature=0.0)
    c = continuation(r, [40, 41, 42], attempt=3)
    assert c.prompt_token_ids == [1, 2, 3, 40, 41, 42] and r.prompt_token_ids == [1, 2, 3]
    assert c.sampling.max_tokens == 7 and c.sampling.seed == 7 and c.sampling.temperature == 0.0
    assert c.request_id == r.request_id and c.attempt == 3 and c.route_key == "r1/3"


def test_the_clients_usage_counts_each_token_once() -> None:
    # the continuation prefilled 3 + 5 tokens (6 cached) and produced 4 more
    u = client_usage(3, 5, Usage(prompt_tokens=8, completion_tokens=4, cached_tokens=6))
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (3, 9, 3)


def test_token_ids_ride_in_the_events_and_are_read_back() -> None:
    first = event_with_ids(sse(stream_chunk(META, "he", None, first=True)), [5, 6])
    second = event_with_ids(sse(stream_chunk(META, "llo", None)), [7])
    assert first.endswith(b"\n: ids 5,6\n\n") and first.startswith(b"data: {")
    split = FrameSplitter()  # the gateway passes them through whole; a comment is not a control frame
    assert split.feed(first + second[:9]) == first and split.feed(second[9:]) == second
    got = parse_emitted([first, second[:9], second[9:]])
    assert got.ids == [5, 6, 7] and got.text == ["he", "llo"] and got.events == 2
    assert got.finish_reason is None
    last = event_with_ids(sse(stream_chunk(META, "!", "length")), [8])
    assert parse_emitted([first, last]).finish_reason == "length"
    done = parse_emitted([sse(stream_chunk(ResponseMeta("completion", "r", "m", 1), "x", "stop"))])
    assert done.text == ["x"] and done.ids == [] and done.finish_reason == "stop"


def test_the_request_body_asks_for_ids_and_says_continued() -> None:
    assert parse_flags(request_body(req(), META, False)) == (False, False)
    assert parse_flags(request_body(req(), META, False, ids=True, continued=True)) == (True, True)
