"""One provider stream as the adapter reads it: what it has seen so far (:class:`StreamState`), and
each network read turned into one batch of chunks (:class:`ChunkReader`).

Kept apart from the adapters (``deployments/providers/providers.py``) because it is the per-read part of the
token path: an OpenAI-wire read of plain ``data:`` events takes a fast path (no event object, and
a plain text delta read straight to its text), everything else the general SSE parser and the
API's own event parser.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from cluster.json_types import JSONObject
from cluster.providers import StreamDelta, openai_wire
from cluster.providers.plain_events import PlainShape, literal_text
from cluster.providers.sse import SSEDecoder, SSEEvent
from cluster.wire.protocol import Chunk, Piece, Usage

LEARNS = 8  # a stream's tries at its plain text events' shape (each costs a parse)


class StreamState:
    """What one request's stream has seen so far, read by its error paths and its cleanup."""

    __slots__ = (
        "charged",
        "done",
        "finish",
        "input_est",
        "last",
        "out_parts",
        "reserved",
        "response",
        "settled",
        "started",
        "usage",
    )

    def __init__(self, input_est: int) -> None:
        self.input_est = input_est
        self.charged = 0  # tokens to charge the budget if the provider never reports usage
        # what came back (a str, or a plain text's JSON string), counted once where no usage is reported
        self.out_parts: list[str | bytes] = []
        self.reserved = self.settled = False
        self.started = False  # content has been yielded
        self.done = False  # the provider said the stream is over
        self.usage: Usage | None = None
        self.finish: str | None = None
        self.last = 0.0  # loop time of the last read
        self.response: aiohttp.ClientResponse | None = None


class ChunkReader:
    """One stream's network reads as batches of chunks. ``parse``: the API's event parser (fresh
    per stream: it may hold state); ``fail``: a mid-stream error object (and whether content had
    started) as the exception to raise; ``openai_data``: the events are OpenAI's plain ``data:``
    lines, so the fast path may read them, and a read that is one whole plain text event of the
    stream's learned shape (:class:`PlainShape`) is its text's JSON string alone, never parsed."""

    __slots__ = (
        "backend",
        "clean",
        "decoder",
        "fail",
        "learns",
        "openai_data",
        "parse",
        "replica",
        "s",
        "shape",
    )

    def __init__(
        self,
        s: StreamState,
        parse: Callable[[SSEEvent], StreamDelta],
        fail: Callable[[JSONObject, bool], Exception],
        replica: str,
        backend: str,
        openai_data: bool = False,
    ) -> None:
        self.s, self.parse, self.fail = s, parse, fail
        self.replica, self.backend = replica, backend
        self.openai_data = openai_data
        self.decoder = SSEDecoder()
        self.shape: PlainShape | None = None
        self.learns = LEARNS if openai_data else 0
        self.clean = True  # the decoder holds nothing: a read may be a whole event

    def read(self, data: bytes) -> tuple[list[Piece], Exception | None]:
        """One network read's content as chunks, and the failure to raise once they are out. A
        plain text delta is its text alone (a ``str``: no object built; :func:`as_chunk`), or, read
        by its shape, its text's JSON string as sent (``bytes``)."""
        shape = self.shape
        if shape is not None and self.clean and (lit := shape.literal(data)) is not None:
            s = self.s
            s.started = True
            s.out_parts.append(lit)
            return [lit], None
        try:
            return self._read(data)
        finally:
            self.clean = self.decoder.idle()

    def _read(self, data: bytes) -> tuple[list[Piece], Exception | None]:
        if self.openai_data and (payloads := self.decoder.feed_data(data)) is not None:
            return self._read_openai(payloads)
        batch: list[Piece] = []
        for ev in self.decoder.feed(data):
            try:
                delta = self.parse(ev)
            except ValueError as exc:
                return batch, exc
            failure = self._take(delta, batch)
            if failure is not None or self.s.done:
                return batch, failure
        return batch, None

    def _read_openai(self, payloads: list[bytes]) -> tuple[list[Piece], Exception | None]:
        s, batch = self.s, list[Piece]()
        for raw in payloads:
            try:
                got = openai_wire.plain_text(raw)
                if type(got) is str:  # the common event: text, nothing else
                    s.started = True
                    s.out_parts.append(got)
                    batch.append(got)
                    if self.learns and b'"role"' not in raw:  # (only a first event has the role)
                        self._learn(raw, got)
                    continue
                delta = StreamDelta(done=True) if got is None else openai_wire.parse_stream_obj(got)
            except ValueError as exc:
                return batch, exc
            failure = self._take(delta, batch)
            if failure is not None or s.done:
                return batch, failure
        return batch, None

    def _learn(self, raw: bytes, text: str) -> None:
        """A plain text event the parser read (no shape yet, or the read was not one whole event of
        it): its shape, when it has one; a shape learned before stays otherwise."""
        self.learns -= 1
        shape = PlainShape.learn(raw, text, openai_wire.plain_text)
        if shape is not None:
            self.shape = shape

    def _take(self, delta: StreamDelta, batch: list[Piece]) -> Exception | None:
        s = self.s
        if delta.error is not None:
            return self.fail(delta.error, s.started)
        s.usage = delta.usage or s.usage
        if delta.index == 0:  # the first choice's ends the stream's last chunk (providers.py)
            s.finish = delta.finish_reason or s.finish
        more = delta.index and delta.finish_reason  # n > 1: another choice's finish is its own chunk
        if delta.text or delta.tool_calls or delta.thinking or delta.logprobs or more:  # all content
            s.started = True
            s.out_parts.append(delta.text)
            batch.append(
                Chunk(
                    text=delta.text,
                    tool_calls=delta.tool_calls,
                    thinking=delta.thinking,
                    replica=self.replica,
                    backend=self.backend,
                    logprobs=delta.logprobs,
                    index=delta.index,
                    finish_reason=delta.finish_reason if delta.index else None,
                )
            )
        if delta.done:
            s.done = True
        return None


def as_chunk(item: Piece, replica: str | None = None, backend: str | None = None) -> Chunk:
    """A batch's item as a :class:`Chunk` (a plain text delta travels as its text alone, or as its
    JSON string)."""
    if isinstance(item, bytes):
        item = literal_text(item)
    return Chunk(text=item, replica=replica, backend=backend) if isinstance(item, str) else item
