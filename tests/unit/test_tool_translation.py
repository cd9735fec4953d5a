"""Tools between OpenAI and Anthropic, against fixtures written from the providers' documented
examples (tests/unit/data/tools/README.md): the upstream request field by field, the stream's
tool_use blocks as OpenAI tool_calls deltas, and the OpenAI passthrough left exactly as sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.providers import anthropic_tools, anthropic_wire, openai_wire
from cluster.providers.sse import SSEDecoder
from cluster.tokens.counters import CharEstimateTokenizer
from cluster.wire.errors import InvalidRequest
from cluster.wire.openai_format import ResponseMeta, full_response, stream_chunk
from cluster.wire.protocol import ChatCompletionRequest, GenerateRequest, Usage
from cluster.wire.requests import build_generate_request, prompt_ids
from cluster.wire.tool_calls import ToolCallAccumulator
from deployments.gateway import http_api as h

DATA = Path(__file__).parent / "data" / "tools"


def _load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def _generate_request(body: dict[str, Any]) -> GenerateRequest:
    """What the gateway builds from a client's body (prepare's steps, without a cluster)."""
    from cluster.config import ModelConfig

    api = h.validate(ChatCompletionRequest, body)
    ids, messages, text = prompt_ids(api, CharEstimateTokenizer(3.5))
    model = ModelConfig(name=api.model, tokenizer="estimate:4", context_window=8192)
    return build_generate_request(
        api, model, ids, messages, text, request_id="r1", surface="chat", session_id=None,
        timeout_s=30, max_tokens=api.max_tokens or 16,
    )  # fmt: skip


def test_a_tool_round_trip_translates_to_the_documented_anthropic_request() -> None:
    req = _generate_request(_load("openai_round_trip.json"))
    body = anthropic_wire.request_body(req, "claude-sonnet-4-5", stream=False)
    assert body == _load("anthropic_round_trip.json")


def test_the_openai_passthrough_sends_every_tool_field_as_the_client_did() -> None:
    sent = _load("openai_round_trip.json")
    body = openai_wire.request_body(_generate_request(sent), "gpt-4o", stream=False)
    for key in ("tools", "tool_choice", "parallel_tool_calls"):
        assert body[key] == sent[key]
    assert body["messages"] == [{k: v for k, v in m.items() if v is not None} for m in sent["messages"]]


@pytest.mark.parametrize(
    ("choice", "parallel", "expected"),
    [
        (None, None, None),
        ("auto", None, {"type": "auto"}),
        ("required", None, {"type": "any"}),
        ("none", None, {"type": "none"}),
        ({"type": "function", "function": {"name": "f"}}, None, {"type": "tool", "name": "f"}),
        ("auto", False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", True, {"type": "any"}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("none", False, {"type": "none"}),
    ],
)
def test_tool_choice_mapping(choice: Any, parallel: bool | None, expected: dict[str, Any] | None) -> None:
    assert anthropic_tools.tool_choice(choice, parallel) == expected


def test_the_documented_tool_use_stream_becomes_openai_tool_call_deltas() -> None:
    state = anthropic_wire.StreamState()
    deltas = [
        state.on_event(ev.event, ev.data)
        for ev in SSEDecoder().feed((DATA / "anthropic_stream.sse").read_bytes())
    ]
    assert "".join(d.text for d in deltas) == "Okay, let's check the weather."
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert calls[0] == {
        "index": 0,
        "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in calls[1:])
    acc = ToolCallAccumulator()
    acc.feed(calls)
    (call,) = acc.calls() or []
    assert json.loads(call["function"]["arguments"]) == {"location": "San Francisco, CA"}
    assert deltas[-1].done and deltas[-1].finish_reason == "tool_calls"


def test_input_json_outside_a_tool_block_is_malformed() -> None:
    state = anthropic_wire.StreamState()
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "input_json_delta", "partial_json": "{"},
    }
    with pytest.raises(ValueError):
        state.on_event("content_block_delta", json.dumps(delta))


def test_parallel_tool_calls_accumulate_by_index() -> None:
    acc = ToolCallAccumulator()
    acc.feed([{"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}])
    acc.feed([{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}])
    acc.feed([{"index": 0, "function": {"arguments": ": 1}"}}, {"index": 1, "function": {"arguments": "{}"}}])
    assert acc.calls() == [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert ToolCallAccumulator().calls() is None


def test_openai_shapes_carry_tool_calls() -> None:
    meta = ResponseMeta(kind="chat", request_id="r", model="m", created=1)
    piece = [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]
    first = stream_chunk(meta, "", None, first=True, tool_calls=piece)["choices"][0]["delta"]
    assert first == {"role": "assistant", "tool_calls": piece}
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msg = full_response(meta, "", "tool_calls", Usage(), calls)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": None, "tool_calls": calls}


def test_tool_call_arguments_that_are_not_a_json_object_are_400() -> None:
    body = _load("openai_round_trip.json")
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = "not json"
    with pytest.raises(InvalidRequest, match="call_12345xyz"):
        anthropic_wire.request_body(_generate_request(body), "claude-x")
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = "[1]"
    with pytest.raises(InvalidRequest, match="object"):
        anthropic_wire.request_body(_generate_request(body), "claude-x")


def test_an_openai_stream_chunk_with_tool_calls_is_parsed() -> None:
    piece = {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    data = json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]})
    assert openai_wire.parse_stream_data(data).tool_calls == [piece]
    bad = json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": "x"}}]})
    with pytest.raises(ValueError):
        openai_wire.parse_stream_data(bad)


def test_tool_definitions_and_calls_are_counted() -> None:
    body = _load("openai_round_trip.json")
    with_tools = _generate_request(body)
    bare = _generate_request(
        {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
    )
    tool_json = json.dumps(body["tools"], separators=(",", ":"))
    # the schemas' characters at 4 per token, at least: the context check and budgets see them
    assert len(with_tools.prompt_token_ids) - len(bare.prompt_token_ids) >= len(tool_json) // 4
    plain = _generate_request(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert len(plain.prompt_token_ids) == len(
        CharEstimateTokenizer(3.5).chat_ids([{"role": "user", "content": "hi"}])
    )


def test_images_and_cache_breakpoints_reach_anthropic() -> None:
    cc = {"type": "ephemeral"}
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Long manual.", "cache_control": cc}]},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                    {"type": "text", "text": "What is in "},
                    {"type": "text", "text": "these?"},
                ],
            },
        ],
    }
    out = anthropic_wire.request_body(_generate_request(body), "claude-x", stream=False)
    assert out["system"] == [{"type": "text", "text": "Long manual.", "cache_control": cc}]
    assert out["messages"][0]["content"] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
        {"type": "text", "text": "What is in these?"},
    ]
    body["messages"][1]["content"][0]["image_url"]["url"] = "file:///etc/passwd"
    with pytest.raises(InvalidRequest, match="image_url"):
        anthropic_wire.request_body(_generate_request(body), "claude-x")
