"""Our /v1/messages translation: the documented Anthropic tool-use request becomes the OpenAI chat
request the gateway serves, and the gateway's answer (whole or streamed) becomes a Messages answer
that our own Anthropic stream parser reads back to the same text and tool calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.providers import anthropic_wire
from cluster.providers.sse import SSEDecoder
from cluster.wire import messages_api as M
from cluster.wire.errors import InvalidRequest
from cluster.wire.messages_stream import MessagesStream
from cluster.wire.openai_format import SSE_DONE, ResponseMeta, sse, stream_chunk, usage_chunk
from cluster.wire.protocol import ChatCompletionRequest, Usage
from cluster.wire.thinking import ThinkingAccumulator
from cluster.wire.tool_calls import ToolCallAccumulator
from deployments.gateway import http_api as h

DATA = Path(__file__).parent / "data" / "tools"


def test_the_documented_round_trip_request_becomes_the_openai_one() -> None:
    anthropic = json.loads((DATA / "anthropic_round_trip.json").read_text())
    openai = json.loads((DATA / "openai_round_trip.json").read_text())
    chat = M.to_chat(anthropic)
    h.validate(ChatCompletionRequest, chat)  # what the gateway then accepts
    assert chat["tools"] == openai["tools"]
    assert chat["tool_choice"] == openai["tool_choice"] and chat["parallel_tool_calls"] is False
    assert chat["messages"][0] == openai["messages"][0]  # system
    assert chat["messages"][1]["content"] == [{"type": "text", "text": openai["messages"][1]["content"]}]
    calls = chat["messages"][2]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        json.loads(c["function"]["arguments"]) for c in openai["messages"][2]["tool_calls"]
    ]
    assert [m["role"] for m in chat["messages"][3:]] == ["tool", "tool"]
    assert chat["messages"][4]["content"] == "22°C, sunny"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 5),
        ("thinking", "enabled"),  # not an object
        ("unknown_field", 1),
        (
            "tools",
            [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        ),
    ],
)
def test_what_has_no_translation_is_a_400_naming_it(field: str, value: Any) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(InvalidRequest) as exc:
        M.to_chat(body)
    assert exc.value.param == field


def test_cache_control_on_text_blocks_stays_on_the_chat_part() -> None:
    cc = {"type": "ephemeral"}
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": [{"type": "text", "text": "rules"}, {"type": "text", "text": "docs", "cache_control": cc}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": cc}]}],
    }
    chat = M.to_chat(body)
    assert chat["messages"][0] == {
        "role": "system",
        "content": [{"type": "text", "text": "rules"}, {"type": "text", "text": "docs", "cache_control": cc}],
    }
    assert chat["messages"][1]["content"] == [{"type": "text", "text": "q", "cache_control": cc}]
    ChatCompletionRequest.model_validate(chat)  # the chat route takes it as is
    img = {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}, "cache_control": cc}
    with pytest.raises(InvalidRequest, match="on a image block"):
        M.to_chat({**body, "messages": [{"role": "user", "content": [img]}]})


THINK = {"type": "thinking", "thinking": "The user wants weather.", "signature": "EqQBCgIYAhIM1gbcDa9G"}
REDACTED = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}


def test_thinking_and_thinking_blocks_pass_as_they_are() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    body = {
        "model": "m",
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [THINK, REDACTED, {"type": "text", "text": "Let me see."}, use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4"}]},
        ],
    }
    chat = M.to_chat(body)
    assert chat["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert chat["messages"][1]["thinking_blocks"] == [THINK, REDACTED]
    api = ChatCompletionRequest.model_validate(chat)
    assert api.messages[1].model_dump(exclude_none=True)["thinking_blocks"] == [THINK, REDACTED]
    late = {**body, "messages": [body["messages"][0], {"role": "assistant", "content": [use, THINK]}]}
    with pytest.raises(InvalidRequest, match="must come first"):
        M.to_chat(late)


def test_a_chat_answer_with_thinking_becomes_thinking_blocks_first() -> None:
    resp = {
        "id": "chatcmpl-t",
        "choices": [{"message": {"role": "assistant", "content": "4", "thinking_blocks": [THINK]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 9},
    }
    assert M.from_chat(resp, "m")["content"] == [THINK, {"type": "text", "text": "4"}]


def test_streamed_thinking_becomes_thinking_and_signature_deltas() -> None:
    meta = ResponseMeta(kind="chat", request_id="r1", model="m", created=1)
    pieces = [
        [{"index": 0, "type": "thinking", "thinking": ""}],
        [{"index": 0, "type": "thinking", "thinking": "The user "}],
        [{"index": 0, "type": "thinking", "thinking": "wants weather."}],
        [{"index": 0, "type": "thinking", "signature": THINK["signature"]}],
        [{"index": 1, "type": "redacted_thinking", "data": REDACTED["data"]}],
    ]
    chunks = [sse(stream_chunk(meta, "", None, first=i == 0, thinking=p)) for i, p in enumerate(pieces)]
    chunks += [sse(stream_chunk(meta, "4", None)), sse(stream_chunk(meta, "", "stop")), SSE_DONE]
    tr = MessagesStream("m")
    events = SSEDecoder().feed(b"".join(tr.feed(c) for c in chunks))
    data = [json.loads(e.data) for e in events]
    starts = [d["content_block"] for d in data if d["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "redacted_thinking", "data": REDACTED["data"]},
        {"type": "text", "text": ""},
    ]
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert deltas[:3] == [
        {"type": "thinking_delta", "thinking": "The user "},
        {"type": "thinking_delta", "thinking": "wants weather."},
        {"type": "signature_delta", "signature": THINK["signature"]},
    ]
    state = anthropic_wire.StreamState()  # our own Anthropic stream reader reads it back
    acc = ThinkingAccumulator()
    for e in events:
        acc.feed(state.on_event(e.event, e.data).thinking or [])
    assert acc.blocks() == [THINK, REDACTED]


def test_tool_choice_any_and_images() -> None:
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [img, {"type": "text", "text": "what is it?"}]}],
        "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "u-1"},
    }
    chat = M.to_chat(body)
    assert chat["tool_choice"] == "required" and chat["user"] == "u-1"
    assert chat["messages"][0]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA"},
    }


def test_a_chat_completion_becomes_a_message() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    resp = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "message": {"role": "assistant", "content": "ok", "tool_calls": calls},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    msg = M.from_chat(resp, "m")
    assert msg["content"] == [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert msg["stop_reason"] == "tool_use" and msg["id"] == "msg_abc"
    assert msg["usage"] == {
        "input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 3,
    }


def test_cache_reads_and_writes_come_back_as_anthropic_usage() -> None:
    u = {
        "prompt_tokens": 3512,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 2000},
        "cache_creation_input_tokens": 1500,
    }
    assert M.usage(u) == {
        "input_tokens": 12,
        "cache_creation_input_tokens": 1500,
        "cache_read_input_tokens": 2000,
        "output_tokens": 3,
    }


def test_the_chat_stream_becomes_a_messages_stream_our_parser_reads_back() -> None:
    meta = ResponseMeta(kind="chat", request_id="r1", model="m", created=1)
    a = [{"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}]
    b = [{"index": 1, "id": "c1", "type": "function", "function": {"name": "g", "arguments": ""}}]
    chunks = [
        sse(stream_chunk(meta, "Let me ", None, first=True)),
        sse(stream_chunk(meta, "look.", None)),
        sse(stream_chunk(meta, "", None, tool_calls=a)),
        sse(stream_chunk(meta, "", None, tool_calls=[{"index": 0, "function": {"arguments": '{"x": '}}])),
        sse(stream_chunk(meta, "", None, tool_calls=[{"index": 0, "function": {"arguments": "1}"}}])),
        sse(stream_chunk(meta, "", None, tool_calls=b)),  # OpenAI streams one call after the other
        sse(stream_chunk(meta, "", "tool_calls")),
        sse(usage_chunk(meta, Usage(prompt_tokens=7, completion_tokens=5))) + SSE_DONE,
    ]
    tr = MessagesStream("m")
    wire = b"".join(tr.feed(c[:5]) + tr.feed(c[5:]) for c in chunks)  # split reads, as the socket does
    events = SSEDecoder().feed(wire)
    assert events[0].event == "message_start" and events[-1].event == "message_stop"
    state = anthropic_wire.StreamState()
    deltas = [state.on_event(e.event, e.data) for e in events]
    assert "".join(d.text for d in deltas) == "Let me look."
    acc = ToolCallAccumulator()
    for d in deltas:
        acc.feed(d.tool_calls or [])
    calls = acc.calls() or []
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("c0", "f", '{"x": 1}'),
        ("c1", "g", ""),
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    assert state.usage is not None and state.usage.completion_tokens == 5 and state.usage.prompt_tokens == 7


def test_a_terminal_error_event_becomes_an_anthropic_error_event() -> None:
    tr = MessagesStream("m")
    out = tr.feed(sse({"error": {"message": "stream interrupted", "type": "server_error"}}) + SSE_DONE)
    (ev,) = SSEDecoder().feed(out)
    assert ev.event == "error" and json.loads(ev.data)["error"]["message"] == "stream interrupted"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("metadata", 1.5),
        ("messages", 3),
        ("tools", {}),
        ("tool_choice", []),
        ("system", {}),
        ("stop_sequences", "x"),
    ],
)
def test_wrong_shapes_are_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        M.to_chat(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], field: value}
        )
    assert exc.value.param == field


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "max_tokens: Field required"),
        ("x", "max_tokens: Input should be a valid integer"),
        (True, "max_tokens: Input should be a valid integer"),
        (2.5, "max_tokens: Input should be a valid integer"),
    ],
)
def test_max_tokens_missing_and_wrong_type_say_which(value: Any, message: str) -> None:
    """A wrong type was once answered "Field required", which sends the caller looking for a typo."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if value is not None:
        body["max_tokens"] = value
    with pytest.raises(InvalidRequest) as exc:
        M.to_chat(body)
    assert exc.value.param == "max_tokens"
    assert exc.value.message == message
