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
from cluster.providers.sse import SSEDecoder, SSEEvent
from cluster.wire.protocol import Chunk, Usage


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
        self.out_parts: list[str] = []  # what came back, counted once, only where no usage is reported
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
    lines, so the fast path may read them."""

    __slots__ = ("backend", "decoder", "fail", "openai_data", "parse", "replica", "s")

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

    def read(self, data: bytes) -> tuple[list[Chunk | str], Exception | None]:
        """One network read's content as chunks, and the failure to raise once they are out. A
        plain text delta is its text alone (a ``str``: no object built; :func:`as_chunk`)."""
        if self.openai_data and (payloads := self.decoder.feed_data(data)) is not None:
            return self._read_openai(payloads)
        batch: list[Chunk | str] = []
        for ev in self.decoder.feed(data):
            try:
                delta = self.parse(ev)
            except ValueError as exc:
                return batch, exc
            failure = self._take(delta, batch)
            if failure is not None or self.s.done:
                return batch, failure
        return batch, None

    def _read_openai(self, payloads: list[bytes]) -> tuple[list[Chunk | str], Exception | None]:
        s, batch = self.s, list[Chunk | str]()
        for raw in payloads:
            try:
                got = openai_wire.plain_text(raw)
                if type(got) is str:  # the common event: text, nothing else
                    s.started = True
                    s.out_parts.append(got)
                    batch.append(got)
                    continue
                delta = StreamDelta(done=True) if got is None else openai_wire.parse_stream_obj(got)
            except ValueError as exc:
                return batch, exc
            failure = self._take(delta, batch)
            if failure is not None or s.done:
                return batch, failure
        return batch, None

    def _take(self, delta: StreamDelta, batch: list[Chunk | str]) -> Exception | None:
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


def as_chunk(item: Chunk | str, replica: str | None = None, backend: str | None = None) -> Chunk:
    """A batch's item as a :class:`Chunk` (a plain text delta travels as its text alone)."""
    return Chunk(text=item, replica=replica, backend=backend) if isinstance(item, str) else item
