"""Provider adapters' pure parts: SSE parsing, OpenAI and Anthropic wire translation, error mapping,
budgets and token counting. No network, no Ray."""

from __future__ import annotations

import asyncio
import email.utils
import json
import pickle
import time
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp.client_reqrep import ConnectionKey

from cluster.config import ModelConfig, ProviderConfig
from cluster.cost import Prices, cost_usd
from cluster.providers import anthropic_wire, openai_wire
from cluster.providers import errors as perrors
from cluster.providers.budget import ProviderBudget, Refusal, Reservation
from cluster.providers.sse import SSEDecoder, SSEError, SSEEvent
from cluster.tokens import load as load_tokens
from cluster.tokens.counters import (
    CharEstimateTokenizer,
    HFFileTokenizer,
    TiktokenTokenizer,
    ensure_offline_vocabulary,
    load_tiktoken,
)
from cluster.wire import errors as E
from cluster.wire.protocol import GenerateRequest, Sampling, Usage
from cluster.wire.thinking import ThinkingAccumulator
from deployments.budgets.provider_budget import LocalBudget
from deployments.providers.provider_http import is_connect_failure


def _req(kind: str = "chat", **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id="r1",
        model="m",
        kind=kind,  # type: ignore[arg-type]
        prompt_token_ids=[],
        sampling=Sampling(max_tokens=int(sampling.pop("max_tokens", 32)), **sampling),  # type: ignore[arg-type]
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use English."},
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "there"}]},
            {
                "role": "assistant",
                "content": "Hello",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
        if kind == "chat"
        else None,
        prompt_text="Once upon" if kind == "completion" else None,
    )


# ------------------------------------------------------------------------------------------------
# SSE
# ------------------------------------------------------------------------------------------------

STREAM = (
    b": comment\r\n"
    b'event: message_start\r\ndata: {"a": 1}\r\n\r\n'
    b"data: line one\ndata: line two\n\n"
    b"id: 7\rretry: 1500\rdata:no-space \xc3\xa9t\xc3\xa9\r\r"
    b"event: lonely\n\n"  # no data: dropped
    b"data\n\n"  # a field with no colon: empty data line
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent("message_start", '{"a": 1}'),
    SSEEvent("message", "line one\nline two"),
    SSEEvent("message", "no-space été", id="7", retry_ms=1500),
    SSEEvent("message", "", id="7"),
    SSEEvent("message", "[DONE]", id="7"),
]


def test_sse_whole_stream() -> None:
    assert SSEDecoder().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_sse_any_split_gives_the_same_events(size: int) -> None:
    # Every split point, including inside CRLF pairs and inside the two-byte UTF-8 characters.
    dec = SSEDecoder()
    got: list[SSEEvent] = []
    for i in range(0, len(STREAM), size):
        got += dec.feed(STREAM[i : i + size])
    assert got == EXPECTED


def test_sse_cr_at_chunk_end_then_lf() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x\r") == []
    assert dec.feed(b"\n\r") == [SSEEvent("message", "x")]  # the LF completes the CRLF; the CR ends the event
    assert dec.feed(b"\ndata: y\n\n") == [SSEEvent("message", "y")]  # no phantom blank line from "\n"


def test_sse_partial_event_at_end_is_dropped() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: complete\n\ndata: partial") == [SSEEvent("message", "complete")]
    assert dec.flush() == []


def test_sse_bounded_buffer() -> None:
    dec = SSEDecoder(max_event_bytes=64)
    with pytest.raises(SSEError):
        dec.feed(b"data: " + b"x" * 100)  # no line end ever
    dec = SSEDecoder(max_event_bytes=64)
    with pytest.raises(SSEError):
        for _ in range(10):
            dec.feed(b"data: " + b"y" * 10 + b"\n")  # many lines, no dispatch


# ------------------------------------------------------------------------------------------------
# OpenAI wire
# ------------------------------------------------------------------------------------------------


def test_openai_chat_body() -> None:
    req = _req(stop=["END"], seed=7, temperature=0.5, top_p=0.9, frequency_penalty=0.5)
    body = openai_wire.request_body(req, "gpt-4o")
    assert openai_wire.endpoint(req) == "/chat/completions"
    assert body["model"] == "gpt-4o" and body["max_tokens"] == 32
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["stop"] == ["END"] and body["seed"] == 7
    assert body["temperature"] == 0.5 and body["top_p"] == 0.9
    assert body["frequency_penalty"] == 0.5 and "presence_penalty" not in body
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_openai_reasoning_models_get_max_completion_tokens() -> None:
    body = openai_wire.request_body(_req(), "o3-mini")
    assert body["max_completion_tokens"] == 32 and "max_tokens" not in body


def test_openai_completion_body() -> None:
    req = _req("completion")
    body = openai_wire.request_body(req, "gpt-3.5-turbo-instruct", stream=False)
    assert openai_wire.endpoint(req) == "/completions"
    assert body["prompt"] == "Once upon" and body["max_tokens"] == 32 and "stream" not in body


def test_openai_stream_chunks() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert openai_wire.parse_stream_data(json.dumps(role)).text == ""
    d = openai_wire.parse_stream_data(
        '{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}'
    )
    assert d.text == "Hi" and d.finish_reason is None and d.usage is None
    d = openai_wire.parse_stream_data('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}')
    assert d.finish_reason == "length"
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    d = openai_wire.parse_stream_data(json.dumps({"choices": [], "usage": usage}))
    assert d.usage == Usage(10, 3, 4)
    d = openai_wire.parse_stream_data('{"choices":[{"text":"abc","index":0,"finish_reason":null}]}')
    assert d.text == "abc"
    assert openai_wire.parse_stream_data("[DONE]").done
    assert openai_wire.parse_stream_data('{"error":{"message":"boom","type":"server_error"}}').error == {
        "message": "boom",
        "type": "server_error",
    }
    for bad in ('{"choices": [', "[1, 2]", '{"id": "x"}', '{"choices":[{"index":0,"delta":{"content":5}}]}'):
        with pytest.raises(ValueError):
            openai_wire.parse_stream_data(bad)


def test_openai_full_response_and_error_fields() -> None:
    obj = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }
    assert openai_wire.parse_response(obj) == ("ok", "stop", Usage(5, 1, 0))
    assert openai_wire.error_fields(b'{"error": {"message": "m", "code": "c"}}') == {
        "message": "m",
        "code": "c",
    }
    assert openai_wire.error_fields(b"<html>") == {}


# ------------------------------------------------------------------------------------------------
# Anthropic wire
# ------------------------------------------------------------------------------------------------


def test_anthropic_request_translation() -> None:
    body = anthropic_wire.request_body(_req(stop=["END"], temperature=1.7), "claude-x")
    assert body["model"] == "claude-x" and body["max_tokens"] == 32 and body["stream"] is True
    assert body["system"] == "Be brief.\n\nUse English."
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][0]["content"] == [{"type": "text", "text": "Hi\n\nthere"}]  # merged
    assert body["messages"][1]["content"][1] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert body["messages"][2]["content"] == [{"type": "tool_result", "tool_use_id": "c1", "content": "42"}]
    assert body["stop_sequences"] == ["END"]
    # Above 1 the gateway refuses before translating (cluster.policy.capabilities); here, a last guard.
    assert body["temperature"] == 1.0
    assert "top_p" not in body  # neutral: not sent (models refuse temperature and top_p together)


def test_anthropic_sampling_defaults_and_completion() -> None:
    body = anthropic_wire.request_body(_req("completion", top_p=0.8), "claude-x", stream=False)
    assert body["messages"] == [{"role": "user", "content": "Once upon"}]
    assert (
        body["top_p"] == 0.8 and "temperature" not in body and "stream" not in body and "system" not in body
    )


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
        ("something_new", "stop"),
    ],
)
def test_anthropic_finish_reasons(stop_reason: str, finish: str) -> None:
    assert anthropic_wire.finish_reason(stop_reason) == finish


def test_anthropic_stream_state() -> None:
    st = anthropic_wire.StreamState()
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "content": [],
            "usage": {
                "input_tokens": 10,
                "cache_read_input_tokens": 20,
                "cache_creation_input_tokens": 5,
                "output_tokens": 1,
            },
        },
    }
    events = [
        ("message_start", start),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "citations_delta", "citation": {}}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 7}},
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    deltas = [st.on_event(name, json.dumps(obj)) for name, obj in events]
    assert "".join(d.text for d in deltas) == "Hello"
    last = deltas[-1]
    assert last.done and last.finish_reason == "length"
    assert last.usage == Usage(
        prompt_tokens=35, completion_tokens=7, cached_tokens=20, cache_creation_tokens=5
    )


def test_anthropic_stream_errors_and_malformed() -> None:
    st = anthropic_wire.StreamState()
    d = st.on_event(
        "error", '{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}'
    )
    assert d.error == {"type": "overloaded_error", "message": "Overloaded"}
    for bad in ('{"type": "content_block_delta"}', '{"type": "message_start"}', "{", '"x"'):
        with pytest.raises(ValueError):
            st.on_event("x", bad)


def test_anthropic_response_to_openai() -> None:
    msg = {
        "id": "msg_1",
        "content": [
            {"type": "text", "text": "Hi"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 1},
    }
    out = anthropic_wire.response_to_openai(msg, "m")
    message = out["choices"][0]["message"]
    assert message["content"] == "Hi" and out["choices"][0]["finish_reason"] == "tool_calls"
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert message["tool_calls"] == [call]
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["total_tokens"] == 6


# ------------------------------------------------------------------------------------------------
# Error mapping
# ------------------------------------------------------------------------------------------------

OPENAI_BODY = json.dumps(
    {"error": {"message": "bad thing", "type": "invalid_request_error", "param": "messages"}}
).encode()
ANTHROPIC_BODY = json.dumps(
    {"type": "error", "error": {"type": "invalid_request_error", "message": "bad thing"}}
).encode()


@pytest.mark.parametrize(
    ("status", "cls", "http"),
    [
        (400, E.InvalidRequest, 400),
        (422, E.InvalidRequest, 422),
        (404, E.NotFound, 404),
        (413, E.PayloadTooLarge, 413),
        (401, E.ProviderAuthError, 502),
        (403, E.ProviderAuthError, 502),
        (429, E.RateLimited, 429),
        (529, E.Overloaded, 503),
        (500, E.BackendUnavailable, 502),
        (503, E.BackendUnavailable, 502),
        (504, E.UpstreamTimeout, 504),
        (408, E.UpstreamTimeout, 504),
    ],
)
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_status_mapping(provider: str, status: int, cls: type[E.ClusterError], http: int) -> None:
    fn = perrors.from_openai_status if provider == "openai" else perrors.from_anthropic_status
    body = OPENAI_BODY if provider == "openai" else ANTHROPIC_BODY
    err = fn(status, body, {"retry-after": "3"}, backend="b1")
    assert type(err) is cls and err.status_code == http and err.backend == "b1"
    if cls in (E.InvalidRequest, E.NotFound, E.PayloadTooLarge):
        assert err.message == "bad thing" and err.action == E.Action.CLIENT  # passed through
        assert err.to_openai()["error"]["message"] == "bad thing"
    if cls is E.ProviderAuthError:
        assert "bad thing" not in err.message and "b1" in err.message and err.action == E.Action.FATAL
    if status in (429, 529):
        assert err.retry_after_s == 3.0 and err.action == E.Action.RETRY_ELSEWHERE


def test_context_length_and_quota() -> None:
    body = json.dumps(
        {"error": {"message": "too long", "code": "context_length_exceeded", "param": "messages"}}
    )
    err = perrors.from_openai_status(400, body.encode(), {}, backend="b")
    assert isinstance(err, E.ContextLengthExceeded) and err.param == "messages"
    body = json.dumps(
        {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 9 > 8"}}
    )
    assert isinstance(
        perrors.from_anthropic_status(400, body.encode(), {}, backend="b"), E.ContextLengthExceeded
    )
    body = json.dumps({"error": {"message": "You exceeded your current quota", "code": "insufficient_quota"}})
    assert isinstance(perrors.from_openai_status(429, body.encode(), {}, backend="b"), E.ProviderAuthError)


def test_retry_after_forms() -> None:
    assert perrors.retry_after_s({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert perrors.retry_after_s({"retry-after": "2.5"}) == 2.5
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert 28 <= (perrors.retry_after_s({"retry-after": date}, now=now) or 0) <= 31
    assert perrors.retry_after_s({"retry-after": "soon"}) is None
    assert perrors.retry_after_s({}) is None


def test_provider_messages_are_scrubbed_of_the_key() -> None:
    key = "sk-live-0123456789abcdef"
    body = json.dumps({"error": {"message": f"header {key} is malformed"}}).encode()
    err = perrors.from_openai_status(400, body, {}, backend="b", secret=key)
    assert key not in err.message and "[redacted]" in err.message


def test_stream_error_before_and_after_content() -> None:
    err = {"type": "overloaded_error", "message": "Overloaded"}
    before = perrors.from_stream_error(err, provider="anthropic", backend="b", started=False)
    assert isinstance(before, E.Overloaded)
    after = perrors.from_stream_error(err, provider="anthropic", backend="b", started=True)
    assert isinstance(after, E.StreamInterrupted) and after.status_code == 502
    oa = perrors.from_stream_error(
        {"message": "x", "type": "server_error"}, provider="openai", backend="b", started=False
    )
    assert isinstance(oa, E.BackendUnavailable)


@pytest.mark.parametrize(
    ("exc", "started", "cls"),
    [
        (httpx.ConnectError("refused"), False, E.BackendUnavailable),
        (httpx.ConnectTimeout("slow"), False, E.UpstreamTimeout),
        (TimeoutError(), False, E.UpstreamTimeout),
        (httpx.RemoteProtocolError("peer closed"), False, E.BackendUnavailable),
        (ValueError("bad json"), False, E.BackendUnavailable),
        (TimeoutError(), True, E.StreamInterrupted),
        (httpx.ReadError("reset"), True, E.StreamInterrupted),
    ],
)
def test_transport_mapping(exc: BaseException, started: bool, cls: type[E.ClusterError]) -> None:
    err = perrors.from_transport(exc, backend="b", started=started, waited_s=1.0)
    assert type(err) is cls


REFUSED_KEY = ConnectionKey("h", 1, False, True, None, None, None)


@pytest.mark.parametrize(
    ("exc", "started", "cls", "says"),
    [
        (aiohttp.ConnectionTimeoutError("slow"), False, E.UpstreamTimeout, "connect timed out"),
        (
            aiohttp.ClientConnectorError(
                ConnectionKey("h", 1, False, True, None, None, None), OSError(111, "x")
            ),
            False,
            E.BackendUnavailable,
            "cannot connect",
        ),
        (TimeoutError(), False, E.UpstreamTimeout, "no first token"),
        (aiohttp.ServerDisconnectedError(), False, E.BackendUnavailable, "connection failed"),
        (aiohttp.ClientPayloadError("cut"), True, E.StreamInterrupted, "broke off"),
        (aiohttp.SocketTimeoutError("quiet"), True, E.StreamInterrupted, "stalled"),
    ],
)
def test_aiohttp_failures_map_as_the_adapter_sees_them(
    exc: BaseException, started: bool, cls: type[E.ClusterError], says: str
) -> None:
    """The adapter's client is aiohttp: its connect failures, timeouts and cut streams map like httpx's."""
    err = perrors.from_transport(
        exc, backend="b", started=started, waited_s=1.0, connect_failed=is_connect_failure(exc)
    )
    assert type(err) is cls
    assert says in err.message


ALL_ERRORS = [
    E.InvalidRequest,
    E.ContextLengthExceeded,
    E.Unauthorized,
    E.NotFound,
    E.PayloadTooLarge,
    E.RateLimited,
    E.Overloaded,
    E.BackendUnavailable,
    E.UpstreamTimeout,
    E.ProviderAuthError,
    E.StreamInterrupted,
]


@pytest.mark.parametrize("cls", ALL_ERRORS)
def test_errors_pickle(cls: type[E.ClusterError]) -> None:
    err = cls("msg", retry_after_s=2.0, backend="b", param="p")
    try:
        raise err from ValueError("cause")
    except E.ClusterError as raised:
        back = pickle.loads(pickle.dumps(raised))
    assert type(back) is cls
    assert (back.message, back.status_code, back.code, back.retry_after_s, back.backend, back.param) == (
        "msg",
        err.status_code,
        err.code,
        2.0,
        "b",
        "p",
    )
    assert back.action == err.action


# ------------------------------------------------------------------------------------------------
# Budget
# ------------------------------------------------------------------------------------------------


def _ok(got: object) -> bool:
    return isinstance(got, Reservation)


def test_budget_in_flight_cap() -> None:
    b = ProviderBudget(max_in_flight=2)
    a = b.reserve("a", 10, 10, 0.0)
    assert _ok(a) and _ok(b.reserve("b", 10, 10, 0.0))
    denied = b.reserve("c", 10, 10, 0.0)
    assert isinstance(denied, Refusal) and denied.reason == "in_flight" and denied.retry_after_s
    b.cancel(a, 0.1)  # type: ignore[arg-type]
    assert _ok(b.reserve("c", 10, 10, 0.1))
    assert _ok(b.reserve("c", 10, 10, 0.1))  # idempotent for one request id


def test_budget_rpm_window_and_retry_after() -> None:
    b = ProviderBudget(rpm=3, window_s=60.0)
    for i, t in enumerate((0.0, 10.0, 20.0)):
        r = b.reserve(f"r{i}", 1, 1, t)
        assert isinstance(r, Reservation)
        b.settle(r, Usage(1, 1).total_tokens, t + 1)
    denied = b.reserve("r3", 1, 1, 30.0)
    assert isinstance(denied, Refusal) and denied.reason == "rpm"
    assert denied.retry_after_s == pytest.approx(30.0)
    assert _ok(b.reserve("r3", 1, 1, 60.0 + 1e-9))  # the first admission left the window


def test_budget_tpm_reserves_then_settles() -> None:
    b = ProviderBudget(tpm=1000, window_s=60.0)
    a = b.reserve("a", 100, 500, 0.0)
    assert isinstance(a, Reservation) and a.tokens == 600
    denied = b.reserve("b", 100, 500, 1.0)
    assert isinstance(denied, Refusal) and denied.reason == "tpm"
    assert denied.retry_after_s == pytest.approx(59.0)
    b.settle(a, Usage(prompt_tokens=100, completion_tokens=50).total_tokens, 2.0)  # used 150 of 600
    assert _ok(b.reserve("b", 100, 500, 2.0))
    assert b.snapshot(2.0)["window_tokens"] == 750
    too_big = b.reserve("c", 900, 200, 3.0)
    assert isinstance(too_big, Refusal) and too_big.reason == "too_large" and too_big.retry_after_s is None


def test_budget_release_charges_what_was_used_and_leaks_expire() -> None:
    b = ProviderBudget(tpm=100, max_in_flight=1, window_s=10.0, reservation_ttl_s=30.0)
    a = b.reserve("a", 10, 40, 0.0)
    assert isinstance(a, Reservation)
    b.settle(a, 20, 1.0)  # ended without usage: what it spent, by the adapter's count
    assert b.snapshot(1.0)["window_tokens"] == 20 and b.in_flight == 0
    assert _ok(b.reserve("leaked", 10, 10, 2.0))
    assert not _ok(b.reserve("x", 1, 1, 3.0))
    assert _ok(b.reserve("x", 1, 1, 40.0)) and b.expired == 1  # the leak could not hold the slot forever


def test_cost() -> None:
    prices = Prices(input=2.0, cached_input=0.5, output=8.0)
    assert cost_usd(
        Usage(prompt_tokens=1_000_000, completion_tokens=500_000, cached_tokens=200_000), prices
    ) == pytest.approx(0.8 * 2.0 + 0.2 * 0.5 + 0.5 * 8.0)
    cfg = ProviderConfig(api="openai", base_url="http://x", cost_per_mtok_input=1.0, cost_per_mtok_output=2.0)
    assert cost_usd(Usage(1_000_000, 1_000_000), Prices.from_config(cfg)) == pytest.approx(3.0)


def test_cache_writes_cost_the_write_price_or_else_the_input_price() -> None:
    u = Usage(
        prompt_tokens=1_000_000, completion_tokens=0, cached_tokens=500_000, cache_creation_tokens=400_000
    )
    priced = Prices(input=3.0, cached_input=0.3, output=15.0, cache_write=3.75)
    assert cost_usd(u, priced) == pytest.approx(0.1 * 3.0 + 0.5 * 0.3 + 0.4 * 3.75)
    assert cost_usd(u, Prices(input=3.0, cached_input=0.3)) == pytest.approx(0.5 * 3.0 + 0.5 * 0.3)
    cfg = ProviderConfig(
        api="anthropic", base_url="http://x", cost_per_mtok_input=3.0, cost_per_mtok_cache_write=3.75
    )
    assert Prices.from_config(cfg).cache_write == 3.75


def test_anthropic_cache_reads_and_writes_reach_the_openai_usage() -> None:
    msg = {
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 1500,
            "cache_read_input_tokens": 2000,
            "output_tokens": 3,
        },
    }
    usage = anthropic_wire.response_to_openai(msg, "m")["usage"]
    assert usage["prompt_tokens"] == 3512 and usage["prompt_tokens_details"] == {"cached_tokens": 2000}
    assert usage["cache_creation_input_tokens"] == 1500
    assert anthropic_wire.parse_usage(msg["usage"]) == Usage(3512, 3, 2000, 1500)
    plain = anthropic_wire.response_to_openai({**msg, "usage": {"input_tokens": 5, "output_tokens": 1}})
    assert "cache_creation_input_tokens" not in plain["usage"]  # the OpenAI shape, exactly, otherwise


async def test_local_budget_waits_for_room_and_gives_up_in_time() -> None:
    lb = LocalBudget(ProviderBudget(max_in_flight=1))
    a = await lb.reserve("a", 1, 1)
    assert isinstance(a, Reservation)
    t0 = time.monotonic()
    denied = await lb.reserve("b", 1, 1, wait_s=0.05)
    assert isinstance(denied, Refusal) and 0.04 <= time.monotonic() - t0 < 1.0
    waiter = asyncio.ensure_future(lb.reserve("c", 1, 1, wait_s=5.0))
    await asyncio.sleep(0.01)
    assert not waiter.done() and lb.snapshot()["waiting"] == 1
    await lb.settle(a, Usage(1, 1).total_tokens)
    assert _ok(await asyncio.wait_for(waiter, 1.0))


# ------------------------------------------------------------------------------------------------
# Token counting
# ------------------------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!", "name": "bob"},
]


@pytest.mark.parametrize(
    ("model", "encoding"), [("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base"), ("o3-mini", "o200k_base")]
)
def test_tiktoken_offline_per_model(model: str, encoding: str) -> None:
    tok = load_tiktoken(model)
    assert isinstance(tok, TiktokenTokenizer) and tok.exact and tok.name == encoding
    assert tok.count("hello world") == 2
    assert tok.decode(tok.encode("naïve café 😀")) == "naïve café 😀"
    # OpenAI's framing: 3 per message + role + content (+ name + 1), 3 to prime the reply.
    expected = (
        3 + sum(3 + tok.count(m["role"]) + tok.count(m["content"]) for m in MESSAGES) + tok.count("bob") + 1
    )
    assert tok.count_chat(MESSAGES) == expected == len(tok.chat_ids(MESSAGES))


def test_tiktoken_special_token_text_is_plain_text() -> None:
    assert load_tiktoken("gpt-4o").count("<|endoftext|>") > 1


def test_tampered_vocabulary_is_refused(tmp_path, monkeypatch) -> None:
    import cluster.tokens.counters as tp

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tp, "_bundled_vocabulary", lambda name: b"not the real vocabulary")
    assert not ensure_offline_vocabulary("cl100k_base")
    assert not ensure_offline_vocabulary("r50k_base")  # not shipped: the caller estimates instead


def test_estimates_and_fallbacks() -> None:
    anth = load_tokens("estimate:3.5", "anthropic")
    assert isinstance(anth, CharEstimateTokenizer) and not anth.exact
    assert anth.count("x" * 35) == 10 and anth.count_chat([{"role": "user", "content": "x" * 35}]) == 14
    assert load_tokens("/no/such/tokenizer", "anthropic").chars_per_token == 3.5  # type: ignore[attr-defined]
    assert load_tokens("/no/such/tokenizer", "openai").chars_per_token == 4.0  # type: ignore[attr-defined]
    model = ModelConfig(name="gpt-4o", tokenizer="tiktoken:gpt-4o", context_window=128000)
    assert load_tokens(model.tokenizer, ProviderConfig(api="openai", base_url="http://x").api).exact


def test_hf_tokenizer_file(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = load_tokens(str(tmp_path), "openai")
    assert isinstance(counter, HFFileTokenizer)
    assert counter.encode("hello world !") == [1, 2, 3]
    assert counter.count_chat([{"role": "user", "content": "hello world"}]) == 4 + 2


def test_anthropic_thinking_streams_as_thinking_blocks_with_their_signature() -> None:
    st = anthropic_wire.StreamState()

    def ev(obj: dict[str, Any]) -> Any:
        return st.on_event(obj["type"], json.dumps(obj))

    deltas = [
        ev(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}
        ),
        ev(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "2+2"},
            }
        ),
        ev(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "=4"}}
        ),
        ev(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "signature_delta", "signature": "EqQB"},
            }
        ),
        ev({"type": "content_block_stop", "index": 0}),
        ev(
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "redacted_thinking", "data": "EmwK"},
            }
        ),
        ev({"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}}),
        ev({"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "4"}}),
    ]
    acc = ThinkingAccumulator()
    for d in deltas:
        acc.feed(d.thinking or [])
    assert acc.blocks() == [
        {"type": "thinking", "thinking": "2+2=4", "signature": "EqQB"},
        {"type": "redacted_thinking", "data": "EmwK"},
    ]
    assert deltas[-1].text == "4" and deltas[-1].thinking is None
    with pytest.raises(ValueError, match="outside a thinking block"):
        ev(
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "signature_delta", "signature": "x"},
            }
        )


def test_thinking_config_and_blocks_go_upstream_as_sent() -> None:
    think = {"type": "thinking", "thinking": "Let me look it up.", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA"}
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "thinking_blocks": [think]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "15 degrees"},
    ]
    req = GenerateRequest(
        request_id="r",
        model="m",
        kind="chat",
        prompt_token_ids=[1],
        sampling=Sampling(max_tokens=2048),
        messages=messages,
        options={"thinking": {"type": "enabled", "budget_tokens": 1024}},
    )
    body = anthropic_wire.request_body(req, "claude-sonnet-4-5")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert body["messages"][1]["content"] == [
        think,
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
    ]
