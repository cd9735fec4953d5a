"""An incremental Server-Sent Events parser over byte chunks, as they come off the socket.

It follows the WHATWG event-stream rules that providers rely on: lines end in CRLF, LF or CR (a CR
at the end of one chunk may pair with an LF at the start of the next), ``:`` starts a comment,
``data`` lines of one event are joined with ``\\n``, a blank line dispatches the event, and an
event without data is dropped. Lines are split on bytes before decoding, so a UTF-8 character cut
across two network reads is never mangled. The buffer is bounded: a peer that never ends a line
(or an event) cannot make us hold an unbounded body in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024


class SSEError(ValueError):
    """The byte stream is not a valid event stream (e.g. an event over the size limit)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    event: str = "message"
    data: str = ""
    id: str | None = None
    retry_ms: int | None = None


class SSEDecoder:
    """Feed bytes, get whole events. ``flush()`` at end of stream returns a last unterminated event
    only if it was complete up to a line end (the spec drops a trailing partial event)."""

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._buf = bytearray()
        self._pending_cr = False  # the last chunk ended in CR: an LF next is part of that line end
        self._event = ""
        self._data: list[str] = []
        self._data_bytes = 0
        self._id: str | None = None
        self._retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._pending_cr = False
        if not (self._data or self._event or self._retry is not None or b"\r" in chunk):
            fast = self._feed_lf(chunk)
            if fast is not None:
                return fast
        self._buf += chunk
        events: list[SSEEvent] = []
        start = 0
        buf = self._buf
        n = len(buf)
        while True:
            end, skip = _next_line_end(buf, start, n)
            if end < 0:
                break
            if end == n - 1 and buf[end] == 0x0D:
                self._pending_cr = True  # maybe half of a CRLF split across reads
            line = bytes(buf[start:end])
            start = end + skip
            ev = self._line(line)
            if ev is not None:
                events.append(ev)
        del buf[:start]
        if len(buf) + self._data_bytes > self._max:
            raise SSEError(f"an SSE event exceeds {self._max} bytes")
        return events

    def _feed_lf(self, chunk: bytes) -> list[SSEEvent] | None:
        """The common read from a provider: events of one ``data:`` line each with LF endings, the
        read cut anywhere (what the last read left over comes first). One split per read instead
        of a scan per line. None for anything else (a comment, a named event, a multi-line event,
        a CR), with nothing consumed: the general parser reads it."""
        payloads = self.feed_data(chunk)
        if payloads is None:
            return None
        return [SSEEvent(data=v.decode("utf-8", errors="replace"), id=self._id) for v in payloads]

    def feed_data(self, chunk: bytes) -> list[bytes] | None:
        """:meth:`feed` for a reader that wants only the ``data`` of plain events, as bytes: the
        fast read of :meth:`_feed_lf` without an event object per event. None, with nothing
        consumed, when the read is anything else: then :meth:`feed` must read it."""
        if self._pending_cr or self._data or self._event or self._retry is not None or b"\r" in chunk:
            return None
        buf = self._buf
        if buf and b"\r" in buf:
            return None
        data = bytes(buf) + chunk if buf else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            return None
        out: list[bytes] = []
        for block in data[:cut].split(b"\n\n"):
            if not block.startswith(b"data:") or b"\n" in block or len(block) > self._max:
                return None
            out.append(block[6:] if block[5:6] == b" " else block[5:])
        rest = data[cut + 2 :]
        if len(rest) > self._max:
            return None  # the general parser raises SSEError for it
        self._buf = bytearray(rest)
        return out

    def idle(self) -> bool:
        """Nothing held between reads: no partial line, event or CR; the next read starts clean."""
        return not (self._buf or self._pending_cr or self._data or self._event or self._retry is not None)

    def flush(self) -> list[SSEEvent]:
        """End of stream: a partial last line is discarded, as the spec says."""
        self._buf.clear()
        self._reset()
        return []

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            return self._dispatch()
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_bytes += len(raw)
            if self._data_bytes > self._max:
                raise SSEError(f"an SSE event exceeds {self._max} bytes")
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = ""
            return None
        ev = SSEEvent(
            event=self._event or "message", data="\n".join(self._data), id=self._id, retry_ms=self._retry
        )
        self._reset()
        return ev

    def _reset(self) -> None:
        self._event = ""
        self._data = []
        self._data_bytes = 0
        self._retry = None


def _next_line_end(buf: bytearray, start: int, n: int) -> tuple[int, int]:
    """Index of the next CR or LF at or after ``start`` and the length of that line ending."""
    lf = buf.find(b"\n", start)
    cr = buf.find(b"\r", start, lf if lf >= 0 else n)
    if cr >= 0:
        return cr, 2 if cr + 1 < n and buf[cr + 1] == 0x0A else 1
    if lf >= 0:
        return lf, 1
    return -1, 0
