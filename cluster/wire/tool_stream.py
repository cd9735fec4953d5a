"""A self-hosted engine's chat stream with tools, as the client's SSE events. Pure.

The engine replica feeds each chunk's text to the request's tool-call parser
(:mod:`cluster.wire.tool_parser`) and writes what comes out: content as ``delta.content``, calls as
``delta.tool_calls`` items (index, then id / type / name on a call's first item, then arguments
pieces). The finish reason is ``tool_calls`` when calls were produced and the engine stopped on
its own (a cut at ``max_tokens`` stays ``length``). A non-streaming answer takes :meth:`text` and
:meth:`calls` for its message.
"""

from __future__ import annotations

from cluster.json_types import JSONObject
from cluster.wire.openai_format import ResponseMeta, sse, stream_chunk
from cluster.wire.tool_parser import Item, collect, make_parser


class ToolEvents:
    def __init__(self, meta: ResponseMeta, spec: JSONObject) -> None:
        self.meta = meta
        self.parser = make_parser(spec, meta.request_id)
        self.items: list[Item] = []

    def event(self, text: str, finish_reason: str | None, first: bool) -> bytes:
        """The events for one chunk (``b""`` when the parser holds all of it back and this is
        not the first or the last)."""
        items = self.parser.feed(text) if text else []
        if finish_reason is not None:
            items += self.parser.finish()
        self.items += items
        events = [
            stream_chunk(self.meta, text, None, first and i == 0, tool_calls=calls)
            for i, (text, calls) in enumerate(_groups(items))
        ]
        if first and not events:
            events.append(stream_chunk(self.meta, "", None, first=True))
        if finish_reason is not None:
            events.append(stream_chunk(self.meta, "", self.finish_reason(finish_reason)))
        return b"".join(sse(e) for e in events)

    def finish_reason(self, reason: str) -> str:
        called = any(isinstance(it, dict) for it in self.items)
        return "tool_calls" if called and reason == "stop" else reason

    def text(self) -> str:
        return collect(self.items)[0]

    def calls(self) -> list[JSONObject] | None:
        return collect(self.items)[1] or None


def _groups(items: list[Item]) -> list[tuple[str, list[JSONObject] | None]]:
    """Runs of content text, or of call items: one event each."""
    out: list[tuple[str, list[JSONObject] | None]] = []
    for it in items:
        if isinstance(it, str):
            if out and out[-1][1] is None:
                out[-1] = (out[-1][0] + it, None)
            else:
                out.append((it, None))
        elif out and out[-1][1] is not None:
            out[-1][1].append(it)
        else:
            out.append(("", [it]))
    return out
