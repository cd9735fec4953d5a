"""The loopback provider servers speak the real wire formats: the official ``openai`` and
``anthropic`` clients parse everything they send, errors included; the raw bytes have the exact
SSE framing; and the servers run as standalone processes controlled over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from fixtures.servers import AnthropicServer, OpenAIServer

KEY = "sk-fidelity-key-0001"
ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def oa_srv() -> Iterator[OpenAIServer]:
    with OpenAIServer(api_key=KEY, output_tokens=6) as srv:
        yield srv


@pytest.fixture(scope="module")
def an_srv() -> Iterator[AnthropicServer]:
    with AnthropicServer(api_key=KEY, output_tokens=6) as srv:
        yield srv


@pytest.fixture
def oa(oa_srv: OpenAIServer) -> openai.OpenAI:
    oa_srv.reset()
    return openai.OpenAI(base_url=oa_srv.base_url, api_key=KEY, max_retries=0)


@pytest.fixture
def an(an_srv: AnthropicServer) -> anthropic.Anthropic:
    an_srv.reset()
    return anthropic.Anthropic(base_url=an_srv.base_url.removesuffix("/v1"), api_key=KEY, max_retries=0)


# ------------------------------------------------------------------------------------------------
# OpenAI
# ------------------------------------------------------------------------------------------------


def test_openai_chat_non_streaming(oa: openai.OpenAI) -> None:
    r = oa.chat.completions.create(model="gpt-test", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "gpt-test"
    assert (
        r.choices[0].message.role == "assistant" and r.choices[0].message.content == "Hello alpha beta gamma"
    )
    assert r.choices[0].finish_reason == "length"
    assert (
        r.usage is not None
        and r.usage.completion_tokens == 4
        and r.usage.total_tokens == r.usage.prompt_tokens + 4
    )
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 0


def test_openai_chat_streaming_with_usage(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(
        model="gpt-test",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello alpha beta gamma delta epsilon"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_streaming_without_usage_and_stop(oa: openai.OpenAI) -> None:
    chunks = list(
        oa.chat.completions.create(model="gpt-test", messages=MESSAGES, stop=["gamma"], stream=True)  # type: ignore[arg-type]
    )
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello alpha beta "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_text_completions(oa: openai.OpenAI) -> None:
    r = oa.completions.create(model="gpt-test", prompt="Once", max_tokens=3)
    assert r.object == "text_completion" and r.choices[0].text == "Hello alpha beta"
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    chunks = list(
        oa.completions.create(
            model="gpt-test", prompt="Once", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello alpha beta"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openai_models(oa: openai.OpenAI) -> None:
    assert [m.id for m in oa.models.list()] == ["gpt-test"]


async def test_openai_async_client(oa_srv: OpenAIServer) -> None:
    client = openai.AsyncOpenAI(base_url=oa_srv.base_url, api_key=KEY, max_retries=0)
    stream = await client.chat.completions.create(
        model="gpt-test", messages=MESSAGES, stream=True, max_tokens=2
    )  # type: ignore[arg-type]
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "Hello alpha"
    await client.close()


@pytest.mark.parametrize(
    ("fault", "exc", "status"),
    [
        ("429:7", openai.RateLimitError, 429),
        ("400", openai.BadRequestError, 400),
        ("401", openai.AuthenticationError, 401),
        ("404", openai.NotFoundError, 404),
        ("422", openai.UnprocessableEntityError, 422),
        ("500", openai.InternalServerError, 500),
        ("503", openai.InternalServerError, 503),
    ],
)
def test_openai_errors(oa: openai.OpenAI, fault: str, exc: type[openai.APIStatusError], status: int) -> None:
    with pytest.raises(exc) as info:
        oa.chat.completions.create(model=f"gpt-test+{fault}", messages=MESSAGES)  # type: ignore[arg-type]
    err = info.value
    assert err.status_code == status and isinstance(err.body, dict) and err.body.get("message")
    assert err.response.headers["x-request-id"].startswith("req_")
    if status == 429:
        assert err.response.headers["retry-after"] == "7" and err.code == "rate_limit_exceeded"


def test_openai_wrong_key(oa_srv: OpenAIServer) -> None:
    client = openai.OpenAI(base_url=oa_srv.base_url, api_key="sk-wrong-1234", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
    assert (
        info.value.code == "invalid_api_key" and "1234" in info.value.message
    )  # masked, as the real API does


def test_openai_mid_stream_error_event(oa: openai.OpenAI) -> None:
    stream = oa.chat.completions.create(model="gpt-test+error_event:2", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    got = []
    with pytest.raises(openai.APIError, match="server had an error"):
        for c in stream:
            got.append(c.choices[0].delta.content)
    assert got == ["", "Hello", " alpha"]
    stream.close()


def test_openai_fault_header_selector(oa: openai.OpenAI, oa_srv: OpenAIServer) -> None:
    with pytest.raises(openai.RateLimitError):
        oa.chat.completions.create(model="gpt-test", messages=MESSAGES, extra_headers={"x-test-fault": "429"})  # type: ignore[arg-type]
    assert oa_srv.stats().records[-1].fault == "429"


def test_openai_raw_sse_framing(oa_srv: OpenAIServer) -> None:
    body = {"model": "gpt-test", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    r = httpx.post(
        f"{oa_srv.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: {") and "\n" not in e
        assert json.loads(e.removeprefix("data: "))["object"] == "chat.completion.chunk"


# ------------------------------------------------------------------------------------------------
# Anthropic
# ------------------------------------------------------------------------------------------------


def test_anthropic_non_streaming(an: anthropic.Anthropic) -> None:
    m = an.messages.create(
        model="claude-test", max_tokens=3, system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text == "Hello alpha beta"
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3 and m.usage.input_tokens > 0


def test_anthropic_stream_helper(an: anthropic.Anthropic) -> None:
    with an.messages.stream(
        model="claude-test",
        max_tokens=100,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yes?"},
            {"role": "user", "content": "Go"},
        ],
        stop_sequences=["delta"],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello alpha beta gamma " and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "delta"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens > 0


def test_anthropic_raw_events(an: anthropic.Anthropic) -> None:
    events = list(
        an.messages.create(
            model="claude-test", max_tokens=2, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].message.usage.input_tokens > 0  # type: ignore[union-attr]
    assert events[5].delta.stop_reason == "max_tokens" and events[5].usage.output_tokens == 2  # type: ignore[union-attr]


def test_anthropic_raw_sse_framing(an_srv: AnthropicServer) -> None:
    body = {
        "model": "claude-test",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(f"{an_srv.base_url}/messages", json=body, headers=headers)
    blocks = [b for b in r.text.split("\n\n") if b]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for b in blocks:
        event_line, data_line = b.split("\n")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")


@pytest.mark.parametrize(
    ("fault", "exc", "status"),
    [
        ("429:4", anthropic.RateLimitError, 429),
        ("529", anthropic.OverloadedError, 529),
        ("500", anthropic.InternalServerError, 500),
        ("401", anthropic.AuthenticationError, 401),
        ("403", anthropic.PermissionDeniedError, 403),
        ("404", anthropic.NotFoundError, 404),
        ("400", anthropic.BadRequestError, 400),
    ],
)
def test_anthropic_errors(
    an: anthropic.Anthropic, fault: str, exc: type[anthropic.APIStatusError], status: int
) -> None:
    with pytest.raises(exc) as info:
        an.messages.create(
            model=f"claude-test+{fault}", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    err = info.value
    assert err.status_code == status and err.body["type"] == "error"  # type: ignore[index]
    assert err.response.headers["request-id"].startswith("req_") and err.request_id
    if status == 429:
        assert err.response.headers["retry-after"] == "4"


def test_anthropic_validation_like_the_real_api(an: anthropic.Anthropic, an_srv: AnthropicServer) -> None:
    with pytest.raises(anthropic.BadRequestError, match="Unexpected role"):
        an.messages.create(model="claude-test", max_tokens=5, messages=[{"role": "system", "content": "x"}])  # type: ignore[list-item]
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        an.messages.create(
            model="claude-test",
            max_tokens=5,
            extra_body={"temperature": 1.5},
            messages=[{"role": "user", "content": "x"}],
        )
    r = httpx.post(
        f"{an_srv.base_url}/messages", json={"model": "c", "max_tokens": 1}, headers={"x-api-key": KEY}
    )
    assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]


def test_anthropic_mid_stream_error_event(an: anthropic.Anthropic) -> None:
    got = []
    with (
        pytest.raises(anthropic.APIStatusError, match="overloaded_error"),
        an.messages.stream(
            model="claude-test+error_event:2", max_tokens=50, messages=[{"role": "user", "content": "Hi"}]
        ) as stream,
    ):
        for t in stream.text_stream:
            got.append(t)
    assert got == ["Hello", " alpha"]


# ------------------------------------------------------------------------------------------------
# Standalone processes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["fixtures.servers.openai_server", "fixtures.servers.anthropic_server"])
def test_standalone_process_and_control_endpoints(module: str) -> None:
    env = {**os.environ, "FIDELITY_KEY": KEY, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", "--api-key-env", "FIDELITY_KEY", "--token-delay", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        base = line.strip().rsplit(" ", 1)[-1]
        assert base.startswith("http://127.0.0.1:") and base.endswith("/v1"), line
        root = base.removesuffix("/v1")
        assert httpx.post(f"{root}/_control/faults", json={"faults": ["429:2"]}).json()["queued"] == 1
        if "openai" in module:
            client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model="gpt-test", messages=MESSAGES)  # type: ignore[arg-type]
            assert (
                client.chat.completions.create(model="gpt-test", messages=MESSAGES).choices[0].message.content
            )  # type: ignore[arg-type]
        else:
            client = anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0)
            with pytest.raises(anthropic.RateLimitError):
                client.messages.create(model="c", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
            assert client.messages.create(
                model="c", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
            ).content
        stats = httpx.get(f"{root}/_control/stats").json()
        assert stats["requests"] == 2 and [r["outcome"] for r in stats["records"]] == ["status:429", "ok"]
        assert httpx.post(f"{root}/_control/reset").json() == {"ok": True}
        assert httpx.get(f"{root}/_control/stats").json()["requests"] == 0
        assert httpx.post(f"{root}/_control/faults", json={"faults": ["bogus"]}).status_code == 400
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
