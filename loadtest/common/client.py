"""The load tests' one reader of a streamed answer: the ``data`` of each event of an OpenAI-style SSE
response, decoded by the project's own SSE decoder (:class:`cluster.providers.sse.SSEDecoder`:
line ends, comments, multi-line data, UTF-8 split across reads), up to ``[DONE]``.

    events = EventStream()
    async for data in events.aiter(response):   # httpx streaming response
        obj = json.loads(data)
    events.done                                  # True once [DONE] came

``iter`` does the same over byte chunks for a synchronous client (Locust's ``requests``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from cluster.providers.sse import SSEDecoder

DONE = "[DONE]"


class EventStream:
    def __init__(self) -> None:
        self.done = False  # the stream ended with [DONE] (not merely closed)
        self._decoder = SSEDecoder()

    def _data(self, chunk: bytes) -> Iterator[str]:
        for ev in self._decoder.feed(chunk):
            if ev.data == DONE:
                self.done = True
                return
            yield ev.data

    async def aiter(self, response: Any) -> AsyncIterator[str]:
        """``response``: an ``httpx.Response`` opened with ``client.stream(...)``, or an aiohttp
        ``ClientResponse`` (its body as it arrives)."""
        chunks = response.aiter_bytes() if hasattr(response, "aiter_bytes") else response.content.iter_any()
        async for chunk in chunks:
            for data in self._data(chunk):
                yield data
            if self.done:
                return

    def iter(self, chunks: Iterable[bytes]) -> Iterator[str]:
        for chunk in chunks:
            yield from self._data(chunk)
            if self.done:
                return
