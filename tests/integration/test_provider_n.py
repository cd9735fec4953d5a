"""``n`` on an OpenAI-compatible provider (issue 45): the adapter sends ``n``, reads each choice's
deltas and finish off the provider's stream by index, and the gateway's framer gives the client
one choice per event (role first, its own finish) and the whole answer's n choices; the provider's
usage (every choice's tokens) is the request's. Against the loopback server: real HTTP, no Ray."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.wire.choices import whole_response
from cluster.wire.framing import ChunkFramer
from cluster.wire.openai_format import ResponseMeta, loads
from cluster.wire.protocol import Usage
from fixtures.servers import OpenAIServer
from tests.integration.test_provider_adapters import KEY, _close_pool, _key_env, collect, make, req  # noqa: F401

N = 4  # tokens per choice


@pytest.fixture(scope="module")
def openai_srv() -> Iterator[OpenAIServer]:
    with OpenAIServer(api_key=KEY, output_tokens=N) as srv:
        yield srv


async def _through(srv: OpenAIServer, kind: str, n: int) -> tuple[list[dict[str, Any]], ChunkFramer]:
    srv.reset()
    r = req(max_tokens=N, kind=kind, n=n)
    chunks, err = await collect(make(srv), r)
    assert err is None
    assert srv.stats().records[-1].body["n"] == n  # sent upstream as asked
    meta = ResponseMeta(kind=kind, request_id="r", model="m")
    framer = ChunkFramer(meta, n)
    data = b"".join(framer.frame([c]) for c in chunks)
    return [loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")], framer


async def test_chat_choices_from_a_provider(openai_srv: OpenAIServer) -> None:
    events, framer = await _through(openai_srv, "chat", 3)
    by_index: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for ev in events:
        assert len(ev["choices"]) == 1
        by_index[ev["choices"][0]["index"]].append(ev["choices"][0])
    assert sorted(by_index) == [0, 1, 2]
    texts = []
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == "length"
        texts.append("".join(c["delta"].get("content") or "" for c in choices))
    assert len(texts[0]) > 0 and texts[1] == texts[2] != texts[0]  # the loopback's reversed tokens
    assert framer.usage is not None and framer.usage.completion_tokens == 3 * N  # the provider's count
    whole = whole_response(framer.meta, framer.choices.whole(), framer.usage)  # type: ignore[union-attr]
    assert [c["message"]["content"] for c in whole["choices"]] == texts


async def test_completion_choices_from_a_provider(openai_srv: OpenAIServer) -> None:
    events, framer = await _through(openai_srv, "completion", 2)
    texts: dict[int, str] = defaultdict(str)
    for ev in events:
        texts[ev["choices"][0]["index"]] += ev["choices"][0]["text"]
    assert sorted(texts) == [0, 1] and texts[0] and texts[1]
    got = framer.choices.whole()  # type: ignore[union-attr]
    assert [c["text"] for c in got] == [texts[0], texts[1]]
    assert [c["finish_reason"] for c in got] == ["length", "length"]
    body = whole_response(framer.meta, got, framer.usage or Usage())
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 2 * N
