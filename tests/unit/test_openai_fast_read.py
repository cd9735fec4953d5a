"""The OpenAI-wire fast read (plain ``data:`` payloads, a plain text delta straight to its text) gives
exactly what the general path gives: the same deltas, the same chunks, the same stream state and
the same failures, however the provider's stream is cut into reads."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cluster.providers import StreamDelta, openai_wire
from cluster.providers.plain_events import literal_text
from cluster.providers.sse import SSEEvent
from deployments.providers.provider_stream import ChunkReader, StreamState, as_chunk

_text = st.sampled_from(["", "Hello", " tok", "é😀", 'say "hi"\n', "[DONE]"])
_delta = st.fixed_dictionaries(
    {},
    optional={
        "role": st.just("assistant"),
        "content": st.one_of(_text, st.none(), st.just(7)),
        "tool_calls": st.one_of(st.none(), st.just([{"index": 0, "id": "c1", "function": {"name": "f"}}])),
    },
)
_choice = st.fixed_dictionaries(
    {"delta": _delta},
    optional={
        "index": st.sampled_from([0, 0, 1]),
        "finish_reason": st.sampled_from([None, None, "stop", "length"]),
        "text": _text,
    },
)
_chunk_obj = st.fixed_dictionaries(
    {"id": st.just("chatcmpl-1"), "object": st.just("chat.completion.chunk")},
    optional={
        "choices": st.one_of(st.lists(_choice, max_size=2), st.just("x")),
        "usage": st.one_of(st.none(), st.just({"prompt_tokens": 3, "completion_tokens": 2})),
        "error": st.one_of(st.none(), st.just({"message": "overloaded", "type": "server_error"})),
    },
)
_payload = st.one_of(
    _chunk_obj.map(orjson.dumps), st.sampled_from([b"[DONE]", b"{", b"[1]", b'"s"', b'{"choices": 1}'])
)


def _delta_of(data: bytes) -> StreamDelta | str:
    try:
        return openai_wire.parse_stream_data(data)
    except ValueError:
        return "ValueError"


def _fast_delta_of(data: bytes) -> StreamDelta | str:
    try:
        got = openai_wire.plain_text(data)
        if type(got) is str:
            return StreamDelta(text=got)
        return StreamDelta(done=True) if got is None else openai_wire.parse_stream_obj(got)
    except ValueError:
        return "ValueError"


def _with_text(**more: Any) -> bytes:
    choice = {"index": more.pop("index", 0), "delta": {"content": "Hi", **more.pop("delta", {})}}
    choice.update(more.pop("choice", {}))
    return orjson.dumps({"choices": [choice], **more})


@settings(max_examples=400, deadline=None)
@given(_payload)
@example(_with_text())
@example(_with_text(usage={"prompt_tokens": 3, "completion_tokens": 2}))
@example(_with_text(error={"message": "x"}))
@example(_with_text(delta={"tool_calls": [{"index": 0, "function": {"name": "f"}}]}))
@example(_with_text(choice={"finish_reason": "stop"}))
@example(_with_text(index=1))
def test_plain_text_reads_what_the_general_parser_reads(data: bytes) -> None:
    got = openai_wire.plain_text(data) if _delta_of(data) != "ValueError" else None
    if type(got) is str:
        assert got  # only non-empty text takes the shortcut
    assert _fast_delta_of(data) == _delta_of(data)


def _stream(payloads: list[bytes], cuts: list[int]) -> list[bytes]:
    """The events as one byte stream, cut into reads at the given points."""
    body = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    points = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    return [body[a:b] for a, b in itertools.pairwise(points) if b > a]


def openai_reader(s: StreamState, fast: bool) -> ChunkReader:
    """A reader of an OpenAI-wire stream into ``s`` (``fast``: the plain ``data:`` fast path and
    the plain text events' shape; else the general parser alone)."""

    def parse(ev: SSEEvent) -> StreamDelta:
        return openai_wire.parse_stream_data(ev.data)

    def fail(error: dict[str, Any], started: bool) -> Exception:
        return RuntimeError(f"{error.get('message')} started={started}")

    return ChunkReader(s, parse, fail, "r0", "b0", openai_data=fast)


def _read_all(reads: list[bytes], fast: bool) -> tuple[list[Any], Any]:
    s = StreamState(10)
    reader = openai_reader(s, fast)
    out: list[Any] = []
    for data in reads:
        batch, failure = reader.read(data)
        chunks = [as_chunk(c, "r0", "b0") for c in batch]  # a plain text delta is its text alone
        out.append([(c.text, c.tool_calls, c.replica, c.backend) for c in chunks])
        if failure is not None:
            out.append(f"{type(failure).__name__}: {failure}")
            break
        if s.done:
            break
    # a part read by its shape is kept as its JSON string: compared as the text it is
    texts = [p if isinstance(p, str) else literal_text(p) for p in s.out_parts]
    state = (s.started, s.done, s.finish, s.usage, texts)
    return out, state


@settings(max_examples=300, deadline=None)
@given(st.lists(_payload, min_size=1, max_size=8), st.lists(st.integers(0, 2000), max_size=6))
def test_the_reader_gives_the_same_chunks_and_state_either_way(
    payloads: list[bytes], cuts: list[int]
) -> None:
    reads = _stream(payloads, cuts)
    assert _read_all(reads, fast=True) == _read_all(reads, fast=False)


def test_a_plain_text_delta_is_one_chunk_and_the_finish_is_state() -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    reads = _stream([orjson.dumps(e) for e in events] + [b"[DONE]"], [])
    chunks, (started, done, finish, usage, parts) = _read_all(reads, fast=True)
    assert chunks == [[("Hi", None, "r0", "b0"), (" there", None, "r0", "b0")]]
    assert (started, done, finish, parts) == (True, True, "stop", ["Hi", " there"])
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 2)
