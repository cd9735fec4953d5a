"""A provider's plain text events read by their bytes (cluster/providers/plain_events.py): the shape
is learned only where the text's string sits in the text's place, a read matches only when it is
one whole plain text event of that shape with an escape-free ASCII string, and a stream read that
way gives exactly the chunks, texts and state the parser gives."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cluster.providers import openai_wire
from cluster.providers.plain_events import PlainShape, joined_text, literal_text
from deployments.providers.provider_stream import StreamState, as_chunk
from tests.unit.test_openai_fast_read import openai_reader

HEAD = {"id": "chatcmpl-up1", "object": "chat.completion.chunk", "created": 7, "model": "up-model"}


def event(text: str | None, finish: str | None = None, **more: Any) -> bytes:
    delta = {} if text is None else {"content": text}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return orjson.dumps({**HEAD, "choices": [choice], "usage": None, **more})


def learn(payload: bytes, text: str) -> PlainShape | None:
    return PlainShape.learn(payload, text, openai_wire.plain_text)


def test_a_learned_shape_reads_whole_plain_events_and_nothing_else() -> None:
    shape = learn(event(" tok1"), " tok1")
    assert shape is not None
    assert shape.literal(b"data: " + event(" tok2") + b"\n\n") == b'" tok2"'
    assert literal_text(b'" tok2"') == " tok2"
    refused = [
        event('say "hi"'),  # an escape
        event("line\n"),
        event("é"),  # not ASCII: its bytes on the wire may be escaped or not
        event(" tok", finish="stop"),
        event(""),  # no text: not a content event
        event(None),
        orjson.dumps({**HEAD, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}),
        orjson.dumps({**HEAD, "id": "chatcmpl-other", "choices": [{"index": 0, "delta": {"content": "x"}}]}),
    ]
    for payload in refused:
        assert shape.literal(b"data: " + payload + b"\n\n") is None, payload
    whole = b"data: " + event(" a") + b"\n\n"
    assert shape.literal(whole + whole) is None  # two events in one read: the parser reads them
    assert shape.literal(whole[:-1]) is None and shape.literal(whole[:40]) is None
    assert shape.literal(b"data:" + event(" a") + b"\n\n") is None  # (no space: another shape)


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        (orjson.dumps({"model": "Hi", "choices": [{"index": 0, "delta": {"content": "\\u0048i"}}]}), "Hi"),
        (b'{"x":{"content":"Hi"},"choices":[{"index":0,"delta":{"content":"\\u0048i"}}]}', "Hi"),
        (event("ab") + b" ", "ab"),  # (still found, and still its place: learned, see below)
        (orjson.dumps({**HEAD, "model": " t", "choices": [{"index": 0, "delta": {"content": " t"}}]}), " t"),
        (event('q"'), 'q"'),
        (event("é"), "é"),
    ],
)
def test_a_shape_is_learned_only_from_the_texts_own_place(payload: bytes, text: str) -> None:
    shape = learn(payload, text)
    if payload.endswith(b" "):
        assert shape is not None and shape.literal(b"data: " + event("cd") + b" \n\n") == b'"cd"'
        return
    assert shape is None  # elsewhere in the event (a model, another object), twice, or escaped


def test_a_completions_event_has_its_shape_too() -> None:
    def text_event(text: str) -> bytes:
        choice = {"index": 0, "text": text}
        return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})

    shape = learn(text_event("abc"), "abc")
    assert shape is not None and shape.literal(b"data: " + text_event("def") + b"\n\n") == b'"def"'


def _read(reads: list[bytes], shapes: bool) -> tuple[list[list[tuple[str, Any]]], Any, int]:
    s = StreamState(10)
    reader = openai_reader(s, fast=True)
    if not shapes:
        reader.learns = 0
    out, literals = [], 0
    for data in reads:
        batch, failure = reader.read(data)
        literals += sum(1 for c in batch if isinstance(c, bytes))
        out.append([(c.text, c.finish_reason) for c in (as_chunk(x, "r0", "b0") for x in batch)])
        assert failure is None
        if s.done:
            break
    return out, (s.started, s.done, s.finish, s.usage, joined_text(s.out_parts)), literals


def test_a_stream_read_by_shape_gives_what_the_parser_gives() -> None:
    texts = ["Hello", " tok1", " tok2", ' "q"', " tok3", "é", " tok4", "\n", " tok5", " tok6"]
    first = {"index": 0, "delta": {"role": "assistant", "content": "Hi"}}
    events = [orjson.dumps({**HEAD, "choices": [first]})]
    events += [event(t) for t in texts] + [event(" end", finish="stop")]
    events += [orjson.dumps({**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 12}})]
    one_per_read = [b"data: " + e + b"\n\n" for e in [*events, b"[DONE]"]]
    coalesced = [one_per_read[0] + one_per_read[1], *one_per_read[2:5], one_per_read[5][:30]]
    coalesced += [one_per_read[5][30:], *one_per_read[6:]]
    for reads in (one_per_read, coalesced):
        fast, fast_state, literals = _read(reads, shapes=True)
        slow, slow_state, none = _read(reads, shapes=False)
        assert fast == slow and fast_state == slow_state and none == 0
        assert literals >= 5  # the plain ASCII texts after the shape was learned went by their bytes
    assert fast_state[4] == "Hi" + "".join(texts) + " end"
