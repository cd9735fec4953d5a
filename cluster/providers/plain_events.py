"""A provider stream's plain text events read by their bytes alone (issue 44: relay CPU per chunk).

An OpenAI-compatible server sends every plain text delta of one stream as the same bytes around
the text: the stream's id, ``created`` and model, the choice's index, ``logprobs`` and
``finish_reason`` are constant from one event to the next. :class:`PlainShape` learns those bytes
from one event that the JSON parser read as a plain text delta, and then tells, from a network
read's bytes, whether the read is one whole such event and what its text's JSON string is: two
comparisons and a regular expression in C instead of an SSE split, a JSON parse and a re-encode.

The learned shape is checked once, by parsing it with a probe text in the string's place: any
event with those bytes around an escape-free ASCII string (no quote, backslash or control
character) is then that plain text delta, whatever the text. Anything else (an escaped or
non-ASCII text, a finish, usage, logprobs, an error, a read holding two events or half of one) is
not matched and goes through the parser as before. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from cluster.json_types import JSON

# A JSON string literal of one or more printable ASCII characters, no escape: its text is its bytes.
_LITERAL = re.compile(rb'"[^"\\\x00-\x1f\x7f-\xff]+"')
_PROBE = b'"llmc-shape-probe"'


def literal_text(lit: bytes) -> str:
    """The text of a JSON string literal :class:`PlainShape` matched (no escapes: its bytes)."""
    return lit[1:-1].decode("ascii")


def joined_text(parts: list[str | bytes]) -> str:
    """The text of a stream's parts, each a text or a JSON string :class:`PlainShape` matched."""
    return "".join([p if isinstance(p, str) else literal_text(p) for p in parts])


class PlainShape:
    """The bytes around the text of one stream's plain text events, as they arrive on the wire:
    ``head`` (``data: `` and the JSON up to the text's string) and ``tail`` (the rest of the JSON and
    the blank line that ends the event)."""

    __slots__ = ("cut", "head", "tail")

    def __init__(self, head: bytes, tail: bytes) -> None:
        self.head, self.tail = head, tail
        self.cut = -len(tail)

    @classmethod
    def learn(cls, payload: bytes, text: str, read: Callable[[bytes], str | JSON]) -> PlainShape | None:
        """The shape of the event whose ``data`` is ``payload``, which ``read`` (the API's plain-text
        reader, :func:`cluster.providers.openai_wire.plain_text`) read as the plain text ``text``;
        None when its text's string cannot be found exactly once where a text goes."""
        if not text.isascii():
            return None  # its bytes on the wire may be escaped or not
        lit = b'"' + text.encode("ascii") + b'"'
        if _LITERAL.fullmatch(lit) is None:
            return None  # the text needs escapes: its bytes on the wire may vary
        at = payload.find(lit)
        if at < 0 or payload.find(lit, at + 1) >= 0:
            return None
        head, tail = payload[:at], payload[at + len(lit) :]
        try:
            probed = read(head + _PROBE + tail)
        except ValueError:
            return None
        if probed != literal_text(_PROBE):
            return None  # the string's place is not the text's
        return cls(b"data: " + head, tail + b"\n\n")

    def literal(self, data: bytes) -> bytes | None:
        """The text's JSON string when ``data`` is exactly one whole plain text event of this
        shape, else None."""
        if data.startswith(self.head) and data.endswith(self.tail):
            lit = data[len(self.head) : self.cut]
            if _LITERAL.fullmatch(lit) is not None:
                return lit
        return None
