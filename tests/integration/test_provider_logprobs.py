"""An OpenAI-compatible provider's ``logprobs`` reach the client: the adapter passes the fields
through (``GenerateRequest.options``), reads the provider's per-token logprobs off its stream and the
gateway frames them in OpenAI's shapes, streamed and whole. Against the loopback server: real HTTP,
no Ray Serve."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.wire.framing import ChunkFramer
from cluster.wire.openai_format import ResponseMeta, loads
from fixtures.servers import OpenAIServer
from tests.integration.test_provider_adapters import KEY, _close_pool, _key_env, collect, make, req  # noqa: F401

N = 5


@pytest.fixture(scope="module")
def openai_srv() -> Iterator[OpenAIServer]:
    with OpenAIServer(api_key=KEY, output_tokens=N) as srv:
        yield srv


def _events(data: bytes) -> list[dict[str, Any]]:
    return [loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


async def _through(srv: OpenAIServer, kind: str, options: dict[str, Any]) -> tuple[list[Any], ChunkFramer]:
    r = dataclasses.replace(req(max_tokens=N, kind=kind), options=options)
    chunks, err = await collect(make(srv), r)
    assert err is None
    framer = ChunkFramer(ResponseMeta(kind=kind, request_id="r", model="m"))
    return _events(b"".join(framer.frame([c]) for c in chunks)), framer


async def test_chat_logprobs_from_a_provider(openai_srv: OpenAIServer) -> None:
    events, framer = await _through(openai_srv, "chat", {"logprobs": True, "top_logprobs": 2})
    entries = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    text = "".join(c["delta"].get("content") or "" for ev in events for c in ev["choices"])
    assert len(entries) == N and "".join(e["token"] for e in entries) == text
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] == -0.25 for e in entries)
    whole = framer.logprobs.whole()
    assert whole is not None and whole["content"] == entries


async def test_completion_logprobs_from_a_provider(openai_srv: OpenAIServer) -> None:
    events, framer = await _through(openai_srv, "completion", {"logprobs": 2})
    lps = [c["logprobs"] for ev in events for c in ev["choices"] if c["logprobs"]]
    text = "".join(c["text"] for ev in events for c in ev["choices"])
    tokens = [t for lp in lps for t in lp["tokens"]]
    assert len(tokens) == N and "".join(tokens) == text
    offsets = [o for lp in lps for o in lp["text_offset"]]
    assert offsets == [len("".join(tokens[:i])) for i in range(N)]
    assert all(len(top) == 2 for lp in lps for top in lp["top_logprobs"])
    whole = framer.logprobs.whole()
    assert whole is not None and whole["tokens"] == tokens


async def test_no_logprobs_asked_none_framed(openai_srv: OpenAIServer) -> None:
    events, framer = await _through(openai_srv, "chat", {})
    assert events and all(c["logprobs"] is None for ev in events for c in ev["choices"])
    assert framer.logprobs.whole() is None
