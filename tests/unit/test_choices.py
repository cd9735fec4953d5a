"""``n`` > 1 (cluster/wire/choices.py): interleaved chunks of several choices become OpenAI's
events, one choice each with its index, role first and finish last per choice, and the whole
answer's choices in index order; the request's build (cluster/wire/requests.py) carries ``n``."""

from __future__ import annotations

import json

import pytest

from cluster.config import ModelConfig
from cluster.wire.choices import ChoiceEvents, whole_response
from cluster.wire.errors import InvalidRequest
from cluster.wire.openai_format import ResponseMeta
from cluster.wire.protocol import ChatCompletionRequest, Chunk, CompletionRequest, Usage
from cluster.wire.requests import build_generate_request

CHAT = ResponseMeta(kind="chat", request_id="r1", model="m", created=1)
TEXT = ResponseMeta(kind="completion", request_id="r1", model="m", created=1)


def _events(data: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: ")]


def _interleaved() -> list[Chunk]:
    return [
        Chunk(text="a", index=0),
        Chunk(text="x", index=1),
        Chunk(text="b", index=0, finish_reason="stop"),
        Chunk(text="y", index=1),
        Chunk(text="z", index=1, finish_reason="length", usage=Usage(5, 5)),
    ]


def test_each_event_holds_one_choice_with_its_index_role_first_finish_last() -> None:
    ev = ChoiceEvents(CHAT, 2, collect=False)
    events = _events(b"".join(ev.event(c) for c in _interleaved()))
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for e in events:
        assert len(e["choices"]) == 1 and e["id"] == "chatcmpl-r1"
        by_index[e["choices"][0]["index"]].append(e["choices"][0])
    for i, text in ((0, "ab"), (1, "xyz")):
        choices = by_index[i]
        assert choices[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content") or "" for c in choices) == text
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert by_index[0][-1]["finish_reason"] == "stop" and by_index[1][-1]["finish_reason"] == "length"
    assert ev.finish_reason == "length"  # a cut choice marks the request's


def test_a_choice_finishes_once_and_an_abort_is_no_finish() -> None:
    ev = ChoiceEvents(TEXT, 2, collect=True)
    out = b"".join(ev.event(c) for c in [Chunk(text="a", index=0, finish_reason="stop"), Chunk(index=1)])
    # a provider's last chunk repeats a finish on choice 0: no second finish event
    assert ev.event(Chunk(index=0, finish_reason="length", usage=Usage(1, 1))) == b""
    assert ev.event(Chunk(index=1, finish_reason="abort")) == b""
    finishes = [e["choices"][0]["finish_reason"] for e in _events(out)]
    assert finishes.count("stop") == 1
    assert [c["finish_reason"] for c in ev.whole()] == ["stop", "abort"]


def test_the_whole_answer_has_every_choice_in_index_order() -> None:
    ev = ChoiceEvents(CHAT, 2, collect=True)
    for c in _interleaved():
        ev.event(c)
    body = whole_response(CHAT, ev.whole(), Usage(5, 5))
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 5
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "stop"),
        (1, "xyz", "length"),
    ]
    text = whole_response(TEXT, [{"text": "p"}, {"text": "q", "finish_reason": "length"}], Usage(1, 2))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in text["choices"]] == [
        (0, "p", "stop"),
        (1, "q", "length"),
    ]


def test_an_index_outside_n_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside n=2"):
        ChoiceEvents(CHAT, 2, collect=False).event(Chunk(text="a", index=2))


def _build(api: ChatCompletionRequest | CompletionRequest, model: ModelConfig):
    kw = {"request_id": "r", "surface": "chat", "session_id": None, "timeout_s": 5.0, "max_tokens": 8}
    return build_generate_request(api, model, [1, 2], None, "p", **kw)


def test_the_request_carries_n_and_refuses_it_with_a_tool_parser() -> None:
    model = ModelConfig(name="m", tokenizer="t", context_window=64, tool_calls={"format": "hermes"})
    assert _build(CompletionRequest(model="m", prompt="p", n=3), model).sampling.n == 3
    assert _build(CompletionRequest(model="m", prompt="p"), model).sampling.n == 1
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest) as info:
        _build(ChatCompletionRequest(model="m", messages=msgs, tools=[tool], n=2), model)
    assert info.value.param == "n"
    none = ChatCompletionRequest(model="m", messages=msgs, tools=[tool], tool_choice="none", n=2)
    assert _build(none, model).sampling.n == 2  # tools shown, nothing parsed: plain choices


def test_an_engine_is_never_asked_for_token_ids_of_several_choices() -> None:
    from cluster.wire.engine_stream import request_body
    from cluster.wire.protocol import GenerateRequest, Sampling

    def body(n: int) -> dict:
        return request_body(
            GenerateRequest("r", "m", "chat", [1], Sampling(max_tokens=4, n=n)), CHAT, False, ids=True
        )

    assert body(1).get("ids") is True and "ids" not in body(2)
