"""cluster.observability.trace: a request's trace as plain data, and the spans it becomes (GenAI
conventions)."""

from __future__ import annotations

import random

from cluster.observability.trace import (
    AttemptSpans,
    RequestTrace,
    engine_span,
    new_id,
    parse_traceparent,
    spans,
    traceparent,
)
from cluster.wire.protocol import GenerateRequest, Sampling, Usage

MS = 1_000_000


def request() -> GenerateRequest:
    return GenerateRequest(
        "rid-1", "tiny", "chat", [1, 2, 3, 4], Sampling(max_tokens=8, seed=7), surface="tab"
    )


def test_traceparent_round_trip_and_bad_values() -> None:
    rng = random.Random(0)
    t, s = new_id(rng, 128), new_id(rng, 64)
    assert parse_traceparent(traceparent(t, s)) == (t, s)
    assert traceparent(1, 2) == "00-00000000000000000000000000000001-0000000000000002-01"
    for bad in (None, "", "00-zz-11-01", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "00-1-2-01"):
        assert parse_traceparent(bad) is None


def test_a_hedged_request_is_one_trace_with_a_span_per_attempt() -> None:
    rng = random.Random(1)
    t = RequestTrace(0xABC, 0xDEF, 0, request(), parent_span_id=0x123)
    t.admitted_ns = 2 * MS
    lost = t.attempt(rng, "vllm", "vllm", 0, False, 3 * MS)
    lost.replica, lost.reason = "r1", "prefix"
    won = t.attempt(rng, "openai", "openai", 1, True, 50 * MS)
    lost.verdict, lost.end_ns = "cancelled", 60 * MS
    won.verdict = "won"  # its span lasts until the request ends
    t.first_token_ns, t.backend = 60 * MS, "openai"
    t.usage, t.finish, t.outcome, t.end_ns = Usage(4, 8, cached_tokens=2), "length", "completed", 90 * MS
    root, admission, a0, a1 = spans(t, now_ns=100 * MS)
    assert {s.trace_id for s in (root, admission, a0, a1)} == {0xABC}
    assert root.parent_span_id == 0x123 and root.kind == "server" and root.name == "chat tiny"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert (
        root.attributes["gen_ai.usage.input_tokens"] == 4
        and root.attributes["gen_ai.usage.output_tokens"] == 8
    )
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["gen_ai.request.seed"] == 7 and root.attributes["llmc.surface"] == "tab"
    assert root.attributes["llmc.ttft_s"] == 0.06 and root.events == (("gen_ai.first_token", 60 * MS, {}),)
    assert root.error is None and (root.start_ns, root.end_ns) == (0, 90 * MS)
    assert admission.parent_span_id == root.span_id and admission.end_ns == 2 * MS
    assert admission.attributes["llmc.admission.wait_s"] == 0.002
    assert a0.parent_span_id == a1.parent_span_id == root.span_id and a0.kind == a1.kind == "client"
    assert a0.attributes["llmc.routing.reason"] == "prefix" and a0.attributes["llmc.replica"] == "r1"
    assert (a0.end_ns, a1.end_ns) == (60 * MS, 90 * MS)
    assert a1.attributes["llmc.hedge"] is True and a1.attributes["gen_ai.provider.name"] == "openai"
    assert len({s.span_id for s in (root, admission, a0, a1)}) == 4


def test_a_rejected_request_is_an_error_with_no_attempt() -> None:
    t = RequestTrace(1, 2, 0, request())
    t.admission_error, t.outcome, t.end_ns = "rate_limit_exceeded", "rejected", 5 * MS
    root, admission = spans(t, now_ns=9 * MS)
    assert root.error == "rejected" and admission.error == "rate_limit_exceeded"
    assert "gen_ai.usage.input_tokens" not in root.attributes and root.events == ()


def test_engine_span_is_a_child_of_the_attempt() -> None:
    s = engine_span((0xA, 0xB), 0xC, request(), "rep", "vllm", (1, 2, 3), Usage(4, 5), None)
    assert (s.trace_id, s.parent_span_id, s.span_id, s.kind) == (0xA, 0xB, 0xC, "server")
    assert s.attributes["gen_ai.provider.name"] == "vllm" and s.attributes["gen_ai.usage.output_tokens"] == 5
    assert s.events == (("gen_ai.first_token", 2, {}),) and (s.start_ns, s.end_ns) == (1, 3)
    failed = engine_span((0xA, 0xB), 0xD, request(), "rep", "sim", (1, None, 3), None, "CancelledError")
    assert failed.error == "CancelledError" and failed.events == ()


def test_attempt_spans_record_only_with_a_trace() -> None:
    off = AttemptSpans(None, random.Random(0))
    assert off.start(1, "b", "vllm", 0, False, 5) is None and off.traceparent(None) is None
    off.ended(1, "won", None, 9)  # no trace: nothing to record, nothing raised
    t = RequestTrace(0xA, 0xB, 0, request())
    on = AttemptSpans(t, random.Random(0))
    first = on.start(1, "b", "vllm", 0, False, 5 * MS)
    hedge = on.start(2, "b", "vllm", 1, True, 6 * MS)
    assert first is not None and hedge is not None and t.attempts == [first, hedge]
    on.routed(first, "r1", "prefix")
    assert (first.replica, first.reason) == ("r1", "prefix")
    assert parse_traceparent(on.traceparent(first)) == (0xA, first.span_id)
    on.ended(2, "failed", "server_error", 7 * MS)
    on.ended(1, "won", None, 8 * MS)
    assert (hedge.verdict, hedge.error, hedge.end_ns) == ("failed", "server_error", 7 * MS)
    assert (first.verdict, first.end_ns) == ("won", None)  # the winner ends with the request
