"""The SSE decoder's fast path (whole single-line ``data`` events, LF endings) gives exactly the
events the general line parser gives, however the stream is cut into reads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.providers.sse import SSEDecoder, SSEEvent


class LineByLine(SSEDecoder):
    """The general parser alone: the reference."""

    def _feed_lf(self, chunk: bytes) -> list[SSEEvent] | None:
        return None


_line = st.sampled_from(
    [
        b'data: {"a":1}',
        b"data:x",
        b"data: ",
        b"data: \xc3\xa9",
        b"event: ping",
        b"id: 7",
        b"retry: 30",
        b": comment",
        b"data: two",
        b"",
        b"data: \xf0\x9f",
    ]
)
_ending = st.sampled_from([b"\n", b"\n", b"\n", b"\r\n", b"\r"])


_simple = st.sampled_from([b'data: {"a":1}\n\n', b"data:x\n\n", b"data: \xc3\xa9\n\n", b"data: [DONE]\n\n"])


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Mostly what providers send (whole one-line data events), now and then anything else."""
    parts = draw(
        st.lists(st.one_of(_simple, _simple, st.lists(st.tuples(_line, _ending), max_size=4)), max_size=20)
    )
    raw = b"".join(p if isinstance(p, bytes) else b"".join(a + b for a, b in p) for p in parts)
    cuts = sorted(draw(st.lists(st.integers(0, max(0, len(raw))), max_size=6)))
    return raw, cuts


def _events(decoder: SSEDecoder, raw: bytes, cuts: list[int]) -> list[SSEEvent]:
    out: list[SSEEvent] = []
    start = 0
    for c in [*cuts, len(raw)]:
        out += decoder.feed(raw[start:c])
        start = c
    return out


@settings(max_examples=400, deadline=None)
@given(streams())
def test_the_fast_path_reads_what_the_line_parser_reads(case: tuple[bytes, list[int]]) -> None:
    raw, cuts = case
    assert _events(SSEDecoder(), raw, cuts) == _events(LineByLine(), raw, cuts)


def test_a_provider_read_takes_the_fast_path_wherever_it_is_cut() -> None:
    d = SSEDecoder()
    assert d._feed_lf(b'data: {"x":1}\n\ndata: [DO') is not None  # what generate_batches mostly sees
    assert d._buf == bytearray(b"data: [DO")  # the cut event waits for the rest
    assert [e.data for e in d.feed(b"NE]\n\n")] == ["[DONE]"]
    assert d._feed_lf(b"event: ping\ndata: 1\n\n") is None  # anything else: the general parser
    assert d._feed_lf(b"data: 1\r\n\r\n") is None
    assert d._buf == bytearray()  # and nothing was consumed
