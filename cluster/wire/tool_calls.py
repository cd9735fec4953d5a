"""OpenAI ``tool_calls`` stream deltas, put back together for a non-streaming answer.

A streamed tool call arrives in pieces keyed by ``index``: the first piece has the call's ``id``,
``type`` and ``function.name``, later ones add to ``function.arguments``. Pure.
"""

from __future__ import annotations

from cluster.json_types import JSONObject


class ToolCallAccumulator:
    """Feeds on ``delta.tool_calls`` lists; :meth:`calls` gives the message's ``tool_calls``."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, JSONObject] = {}

    def feed(self, deltas: list[JSONObject]) -> None:
        for d in deltas:
            index = int(d.get("index", 0))
            call = self._calls.setdefault(
                index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if d.get("id"):
                call["id"] = d["id"]
            fn = d.get("function") or {}
            if fn.get("name"):
                call["function"]["name"] = fn["name"]
            if fn.get("arguments"):
                call["function"]["arguments"] += fn["arguments"]

    def calls(self) -> list[JSONObject] | None:
        return [self._calls[i] for i in sorted(self._calls)] if self._calls else None
