"""The one stream seam (cluster/wire/stream.py): a provider adapter's typed chunks framed into the
client's SSE bytes (cluster/wire/framing.py), and an engine's end frame, end in the same shape."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

from cluster.providers.plain_events import joined_text
from cluster.wire.engine_stream import StreamEnd
from cluster.wire.framing import ChunkFramer, FramedStream, framed
from cluster.wire.openai_format import ResponseMeta
from cluster.wire.protocol import Chunk, Piece, Usage
from cluster.wire.stream import Ending, ending_of

META = ResponseMeta(kind="chat", request_id="r", model="m", created=1)


def _deltas(data: bytes) -> list[dict[str, object]]:
    return [json.loads(line[6:])["choices"][0] for line in data.split(b"\n") if line.startswith(b"data: ")]


async def test_a_providers_batches_leave_framed_and_end_in_one_shape() -> None:
    closed: list[bool] = []

    async def batches() -> AsyncGenerator[list[Chunk], None]:
        try:
            yield [Chunk("Hel"), Chunk("lo")]  # one network read: one write
            yield [Chunk(" you", finish_reason="stop", usage=Usage(3, 3))]
            yield [Chunk("never read")]
        finally:
            closed.append(True)

    stream = FramedStream(framed(batches(), framer := ChunkFramer(META)), framer)
    first = await anext(stream)
    assert [d["delta"] for d in _deltas(first)] == [
        {"role": "assistant", "content": "Hel"},
        {"content": "lo"},
    ]
    assert not stream.finish_held and stream.events == 2 and stream.replica is None
    last = await anext(stream)
    assert _deltas(last)[0]["finish_reason"] == "stop" and stream.finish_held  # leaves with the tail
    assert stream.emitted() is None and stream.fault is None  # never continued elsewhere
    assert stream.ending() == Ending("stop", Usage(3, 3), "Hello you")
    await stream.aclose()  # what the race's cancel does: the adapter's stream is closed upstream
    assert closed == [True]


async def test_n_choices_end_with_each_choice() -> None:
    async def batches() -> AsyncGenerator[list[Chunk], None]:
        yield [Chunk("a", index=0), Chunk("b", index=1)]
        yield [Chunk("", finish_reason="stop", index=1), Chunk("", finish_reason="length", index=0)]

    stream = FramedStream(framed(batches(), framer := ChunkFramer(META, n=2)), framer)
    items = [item async for item in stream]
    assert len(items) == 2
    end = stream.ending()
    assert end.choices is not None
    assert [(c["text"], c["finish_reason"]) for c in end.choices] == [("a", "length"), ("b", "stop")]


def test_an_engines_end_frame_is_the_same_ending() -> None:
    end = StreamEnd("length", Usage(5, 2), None, "r1", tool_calls=[], prompt_logprobs=[None])
    assert ending_of(end) == Ending("length", Usage(5, 2), "", None, None, None, None, [None])


def test_a_plain_text_delta_frames_as_its_chunk_would() -> None:
    """A provider's plain text delta travels as its text alone (deployments/providers/provider_stream.py);
    framed, it is the same bytes as its Chunk, and so is its JSON string as the provider sent it
    (cluster/providers/plain_events.py): the first event (role), the common one, one after
    pending logprobs (they ride on it), and with n > 1 (each event names its choice)."""
    entry = {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
    for n in (1, 2):
        plain, typed, literal = ChunkFramer(META, n), ChunkFramer(META, n), ChunkFramer(META, n)
        script: list[list[Piece]] = [["Hel", "lo"], [Chunk("", logprobs=[entry])], [" you"]]
        out = []
        for batch in script:
            as_typed = [Chunk(c) if isinstance(c, str) else c for c in batch]
            as_literal = [b'"' + c.encode() + b'"' if isinstance(c, str) else c for c in batch]
            out.append(plain.frame(batch))
            assert out[-1] == typed.frame(as_typed) == literal.frame(as_literal)
        parts = ["Hel", "lo", " you"] if n == 1 else []  # n > 1: the choices collect their own
        assert (plain.tokens, plain.parts) == (typed.tokens, typed.parts) == (3, parts)
        assert (literal.tokens, joined_text(literal.parts)) == (3, "".join(parts))
        assert b'"role"' in out[0] and (n > 1 or b'"logprob"' in out[2])  # the logprobs ride on
