"""Tools on self-hosted engines, the pure parts: the plan per tool_choice and the schema it builds
(cluster.wire.tool_schema), the tiny model's tool-aware template and the prompt's count
(cluster.wire.requests), the stream's events (cluster.wire.tool_stream), and the capability table."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster import tokens
from cluster.config import ToolCallsConfig
from cluster.policy import capabilities as C
from cluster.wire.errors import InvalidRequest
from cluster.wire.openai_format import ResponseMeta, loads
from cluster.wire.protocol import ChatCompletionRequest
from cluster.wire.requests import prompt_ids
from cluster.wire.tool_schema import call_list_schema, plan
from cluster.wire.tool_stream import ToolEvents

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}, "urgent": {"type": "boolean"}},
            "required": ["unit", "urgent"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _req(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **kw})


def test_the_plan_per_tool_choice() -> None:
    assert plan(_req()) is None and plan(_req(tools=[])) is None
    none = plan(_req(tools=[WEATHER], tool_choice="none"))
    assert none is not None and not none.render_tools and none.parse is None and none.structured is None
    auto = plan(_req(tools=[WEATHER]))
    assert auto is not None and auto.render_tools and auto.parse == {"mode": "hermes"} and not auto.structured
    one = plan(_req(tools=[WEATHER], parallel_tool_calls=False))
    assert one is not None and one.parse == {"mode": "hermes", "max_calls": 1, "stop": ["</tool_call>"]}
    named = plan(
        _req(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert named is not None and named.parse == {"mode": "named", "name": "get_weather"}
    assert named.structured == {"json": WEATHER["function"]["parameters"]}
    req = plan(_req(tools=[WEATHER, CLOCK], tool_choice="required"))
    assert req is not None and req.parse == {"mode": "list"} and req.structured is not None
    with pytest.raises(InvalidRequest, match="response_format"):
        plan(_req(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}))


def test_the_call_list_schema_takes_valid_calls_only() -> None:
    tools = _req(tools=[WEATHER, CLOCK]).tools
    assert tools is not None
    many, one = call_list_schema(tools, parallel=True), call_list_schema(tools, parallel=False)
    good = [
        {"name": "get_weather", "arguments": {"unit": "c", "urgent": True}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(good, many)
    jsonschema.validate(good[:1], one)
    for bad, schema in [
        ([], many),  # at least one call
        (good, one),  # at most one without parallel calls
        ([{"name": "get_weather", "arguments": {"unit": "kelvin", "urgent": True}}], many),
        ([{"name": "nope", "arguments": {}}], many),
        ([{"name": "get_time"}], many),
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


HISTORY = [
    *ASK,
    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"unit":"c","urgent":false}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "14 C, cloudy"},
]  # fmt: skip


def test_the_template_renders_tools_calls_and_results_and_the_count_includes_them() -> None:
    tok = tokens.load("@tiny")
    assert isinstance(tok, tokens.HFTokenizer)
    api = _req(tools=[WEATHER], messages=HISTORY)
    ids, messages, _ = prompt_ids(api, tok, tool_calls=ToolCallsConfig())
    text = tok.decode(ids)
    assert json.dumps(WEATHER["function"]) in text  # the definition, as the template writes it
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit":"c","urgent":false}}\n</tool_call>' in text
    )
    assert "<tool_response>\n14 C, cloudy\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert messages is not None and ids == tok.tool_chat_ids(
        messages, [api.tools[0].model_dump(exclude_none=True)]
    )
    # tool_choice none: the tools are not shown (nor counted), the history still is
    hidden, _, _ = prompt_ids(
        _req(tools=[WEATHER], messages=HISTORY, tool_choice="none"), tok, None, ToolCallsConfig()
    )
    assert "<tools>" not in tok.decode(hidden) and "<tool_response>" in tok.decode(hidden)
    assert len(ids) > len(hidden)
    # no tools at all: the same ids as before the template knew tools (v2's ChatML)
    assert prompt_ids(_req(), tok, None, ToolCallsConfig())[0] == tok.chat_ids(ASK)


def _events(data: bytes) -> list[dict[str, Any]]:
    return [loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def test_the_stream_gives_tool_call_deltas_and_the_finish_reason() -> None:
    meta = ResponseMeta(kind="chat", request_id="r9", model="m", created=1)
    ev = ToolEvents(meta, {"mode": "hermes"})
    out = _events(ev.event("Sure. <tool_", None, True))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Sure. "}
    out = _events(ev.event('call>{"name": "get_weather", "arguments": {"unit": "c"', None, False))
    call = out[0]["choices"][0]["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["id"] and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"unit": "c"'}
    out = _events(ev.event("}}</tool_call>", "stop", False))
    assert out[0]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": "}"}}]
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert ev.text() == "Sure. " and ev.calls() == [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"unit": "c"}'},
        }
    ]
    plain = ToolEvents(meta, {"mode": "hermes"})
    assert _events(plain.event("", "length", True))[-1]["choices"][0]["finish_reason"] == "length"
    assert plain.calls() is None


def test_tools_on_vllm_only_for_models_with_a_tool_call_format() -> None:
    used = C.used_fields(_req(tools=[WEATHER], messages=HISTORY))
    assert {"tools", "messages[].tool_calls", "messages[].role=tool"} <= set(used)
    assert C.unsupported(used, "vllm", tools=True) == []
    assert C.unsupported(used, "vllm")[0] == "tools"  # no format: a 400 naming it
    assert C.unsupported(used, "sim", tools=True)  # the simulator writes no calls
    strict = C.used_fields(_req(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]))
    assert C.unsupported(strict, "vllm", tools=True) == ["tools[].function.strict"]


def test_a_configured_template_overrides_the_tokenizers_own() -> None:
    tok = tokens.load("@tiny")
    assert isinstance(tok, tokens.HFTokenizer)
    own = (
        "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    ids, _, _ = prompt_ids(_req(tools=[WEATHER, CLOCK]), tok, None, ToolCallsConfig(chat_template=own))
    assert tok.decode(ids) == "[get_weather][get_time]Weather in Paris?"
