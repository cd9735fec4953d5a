"""Our minimal /v1/responses: input items become the chat request, the answer (whole or streamed)
becomes a Response object the official openai client parses, events in order with sequence
numbers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from cluster.providers.sse import SSEDecoder
from cluster.wire import responses_api as R
from cluster.wire.errors import InvalidRequest
from cluster.wire.openai_format import SSE_DONE, ResponseMeta, sse, stream_chunk, usage_chunk
from cluster.wire.protocol import ChatCompletionRequest, Usage
from cluster.wire.responses_stream import ResponsesStream
from deployments.gateway import http_api as h

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def test_input_items_become_chat_messages() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "14C"},
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 20,
        "text": {
            "format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
        },
    }
    chat = R.to_chat(body)
    h.validate(ChatCompletionRequest, chat)
    assert [m["role"] for m in chat["messages"]] == ["developer", "user", "assistant", "tool"]
    assert chat["messages"][2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_tokens"] == 20
    assert chat["response_format"]["json_schema"] == {
        "name": "w",
        "schema": {"type": "object"},
        "strict": True,
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [("previous_response_id", "resp_1"), ("store", True), ("reasoning", {"effort": "low"}), ("include", [])],
)
def test_stateful_and_unknown_fields_are_400(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        R.to_chat({"model": "m", "input": "hi", field: value})
    assert exc.value.param == field


def test_built_in_tools_are_400() -> None:
    with pytest.raises(InvalidRequest, match="function tools"):
        R.to_chat({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]})


def test_a_chat_completion_becomes_a_response_the_client_parses() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    resp = {
        "id": "chatcmpl-abc",
        "choices": [{"message": {"content": "hi", "tool_calls": calls}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    }
    parsed = Response.model_validate(R.from_chat(resp, "m"))
    assert parsed.output_text == "hi"
    assert [o.type for o in parsed.output] == ["message", "function_call"]
    assert parsed.output[1].call_id == "call_1" and parsed.usage and parsed.usage.total_tokens == 7


def test_the_chat_stream_becomes_responses_events() -> None:
    meta = ResponseMeta(kind="chat", request_id="r1", model="m", created=1)
    call = [{"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": ""}}]
    wire = b"".join(
        [
            sse(stream_chunk(meta, "Hel", None, first=True)),
            sse(stream_chunk(meta, "lo", None)),
            sse(stream_chunk(meta, "", None, tool_calls=call)),
            sse(
                stream_chunk(meta, "", None, tool_calls=[{"index": 0, "function": {"arguments": '{"a":1}'}}])
            ),
            sse(stream_chunk(meta, "", "tool_calls")),
            sse(usage_chunk(meta, Usage(3, 4))) + SSE_DONE,
        ]
    )
    tr = ResponsesStream("m")
    events = [json.loads(e.data) for e in SSEDecoder().feed(tr.feed(wire))]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.output[1].arguments == '{"a":1}' and final.usage and final.usage.output_tokens == 4


@pytest.mark.parametrize(
    ("field", "value"), [("input", 3), ("tools", 1.5), ("tool_choice", []), ("text", "x")]
)
def test_wrong_shapes_are_400_naming_the_field(field: str, value: Any) -> None:
    body = {"model": "m", "input": "hi", field: value}
    with pytest.raises(InvalidRequest) as exc:
        R.to_chat(body)
    assert exc.value.param == field
