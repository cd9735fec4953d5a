"""Typed chunks as the client's SSE bytes: :class:`ChunkFramer` frames them, and
:class:`FramedStream` is the :class:`cluster.wire.stream.AttemptStream` of a backend whose stream
is typed chunks, a batch per network read (a provider adapter, ``deployments/providers/providers.py``).
Pure: no I/O of its own."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable

from cluster.providers.plain_events import joined_text, literal_text
from cluster.wire.choices import ChoiceEvents
from cluster.wire.engine_stream import Emitted
from cluster.wire.logprobs import LogprobsFraming
from cluster.wire.openai_format import ResponseMeta, TextEvents, sse, stream_chunk
from cluster.wire.protocol import Chunk, Piece, Usage
from cluster.wire.stream import Ending, Fault
from cluster.wire.thinking import ThinkingAccumulator
from cluster.wire.tool_calls import ToolCallAccumulator


class ChunkFramer:
    """Frames typed chunks as the client's SSE events (engines send them framed); a batch (what one
    network read brought) becomes one write. It keeps what a collecting client is answered."""

    def __init__(self, meta: ResponseMeta, n: int = 1) -> None:
        self.meta = meta
        self.text_events = TextEvents(meta)
        self.sent_first = False
        self.finished = False  # the finish event is framed: only the stream's tail comes after it
        self.parts: list[str | bytes] = []  # texts, or their JSON strings as a provider sent them
        self.usage: Usage | None = None
        self.finish = "stop"
        self.tokens = 0
        self.tool_calls = ToolCallAccumulator()
        self.thinking = ThinkingAccumulator()
        self.logprobs = LogprobsFraming(meta.kind, collect=True)  # a provider's, if it sent any
        self.choices = ChoiceEvents(meta, n, collect=True) if n > 1 else None

    def frame(self, batch: list[Piece]) -> bytes:
        if len(batch) == 1:
            return self.frame_one(batch[0])
        return b"".join([self.frame_one(c) for c in batch])

    def frame_one(self, chunk: Piece) -> bytes:
        """One chunk's event (b"": none). A ``str`` is a plain text delta, the common chunk: past
        the first event it is framed straight from its text, no object built or read; ``bytes``
        is such a text's JSON string as the provider sent it, framed as it is."""
        if type(chunk) is bytes:
            if self.sent_first and self.choices is None and not self.logprobs.pending:
                self.tokens += 1
                self.parts.append(chunk)
                return self.text_events.literal(chunk)
            chunk = literal_text(chunk)
        if type(chunk) is str:
            if self.sent_first and self.choices is None and not self.logprobs.pending:
                self.tokens += 1
                self.parts.append(chunk)
                return self.text_events.event(chunk)
            chunk = Chunk(text=chunk)
        assert isinstance(chunk, Chunk)
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason
        if self.choices is not None:  # n > 1: each chunk's event names its choice
            return self._choice_event(chunk, self.choices)
        calls, thinking = chunk.tool_calls, chunk.thinking
        self.logprobs.add(chunk.logprobs)  # they ride on the next event, as an engine's do
        if not (chunk.text or calls or thinking or chunk.finish_reason is not None or not self.sent_first):
            return b""
        if chunk.text or calls or thinking:
            self.tokens += 1
            self.parts.append(chunk.text)
        if calls:
            self.tool_calls.feed(calls)
        if thinking:
            self.thinking.feed(thinking)
        lp = self.logprobs.take()
        if not (calls or thinking or lp) and self.sent_first and chunk.finish_reason is None:
            return self.text_events.event(chunk.text)  # the common case: text, nothing else
        first = not self.sent_first
        self.finished = chunk.finish_reason is not None
        c = stream_chunk(self.meta, chunk.text, chunk.finish_reason, first, calls, thinking, lp)
        data = sse(c)
        self.sent_first = True
        return data

    def _choice_event(self, chunk: Chunk, choices: ChoiceEvents) -> bytes:
        if chunk.text or chunk.tool_calls:
            self.tokens += 1
        data = choices.event(chunk)
        self.finish = choices.finish_reason
        self.sent_first = self.sent_first or bool(data)
        return data


async def framed(
    batches: AsyncGenerator[list[Piece], None], framer: ChunkFramer
) -> AsyncGenerator[bytes, None]:
    """Each batch of ``batches`` as ``framer`` frames it, for a source that cannot frame its own (a
    provider adapter frames as it reads: ``ProviderBackend.generate_framed``)."""
    try:
        async for batch in batches:
            yield framer.frame(batch)
    finally:
        await batches.aclose()


class FramedStream:
    """One attempt on a backend that streams typed chunks, a batch per network read (a provider
    adapter): ``frames`` is each batch as ``framer`` framed it, the client's SSE bytes, one write
    each. Iterating it iterates ``frames`` itself: no frame of its own per chunk. Closing it closes
    the adapter's stream (which aborts the provider's HTTP stream)."""

    __slots__ = ("_frames", "framer")

    def __init__(self, frames: AsyncGenerator[bytes, None], framer: ChunkFramer) -> None:
        self._frames, self.framer = frames, framer

    @property
    def replica(self) -> str | None:
        return None  # a provider's: no replica of ours

    @property
    def events(self) -> int:
        return self.framer.tokens

    @property
    def finish_held(self) -> bool:
        return self.framer.finished

    @property
    def fault(self) -> Fault | None:
        return None

    def ending(self) -> Ending:
        """What the chunks said so far: a provider's stream has no end frame of its own."""
        f = self.framer
        choices = f.choices.whole() if f.choices is not None else None
        calls, thinking, logprobs = f.tool_calls.calls(), f.thinking.blocks(), f.logprobs.whole()
        return Ending(f.finish, f.usage, joined_text(f.parts), calls, thinking, logprobs, choices)

    @property
    def placed_at(self) -> float | None:
        return None  # a provider's: no replica of ours

    def emitted(self) -> Emitted | None:
        return None  # no token ids: a broken provider stream is not continued

    def won(self) -> None:
        pass  # no replica of ours counts it

    def finished(self) -> None:
        pass

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        return self._frames

    def __anext__(self) -> Awaitable[bytes]:
        return self._frames.__anext__()

    async def aclose(self) -> None:
        await self._frames.aclose()
