"""Anthropic's extended thinking in the chat shape, exactly: the blocks keep their signatures. Pure.

The chat shape has no thinking, so we use LiteLLM's extension fields. A request's ``thinking``
config goes upstream as sent; an assistant message's ``thinking_blocks`` (each as the API gave it:
``{"type": "thinking", "thinking", "signature"}`` or ``{"type": "redacted_thinking", "data"}``) go
first in its turn, unchanged: the API checks the signatures, and one changed byte fails them. Only
Anthropic backends take either (:mod:`cluster.policy.capabilities`).

An answer's thinking streams as ``delta.thinking_blocks`` items, indexed among the thinking blocks
as ``tool_calls`` are among the calls: ``{"index", "type": "thinking", "thinking": piece}`` (the
first one opens the block, maybe empty), ``{"index", "type": "thinking", "signature": s}``, and
``{"index", "type": "redacted_thinking", "data": d}`` (whole, at once). :class:`ThinkingStream` makes
them from Anthropic's events (``content_block_start`` of a thinking or redacted_thinking block,
``thinking_delta``, ``signature_delta``); :class:`ThinkingAccumulator` puts them back together as a
message's ``thinking_blocks``.
"""

from __future__ import annotations

from cluster.json_types import JSONObject

KINDS = ("thinking", "redacted_thinking")


def _string(obj: JSONObject, key: str) -> str:
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"{key} is not a string")
    return value


class ThinkingStream:
    """Stream state: which Anthropic content block is which thinking block."""

    __slots__ = ("_index",)

    def __init__(self) -> None:
        self._index: dict[int, int] = {}  # content block index -> thinking block index

    def start(self, block_index: int, block: JSONObject) -> list[JSONObject] | None:
        kind = block.get("type")
        if kind not in KINDS:
            return None
        i = self._index[block_index] = len(self._index)
        if kind == "redacted_thinking":
            return [{"index": i, "type": kind, "data": _string(block, "data")}]
        item: JSONObject = {"index": i, "type": kind, "thinking": _string(block, "thinking")}
        if block.get("signature"):
            item["signature"] = _string(block, "signature")
        return [item]

    def delta(self, block_index: int, delta: JSONObject) -> list[JSONObject] | None:
        """A ``thinking_delta`` or ``signature_delta``. Raises ValueError outside a thinking block."""
        i = self._index.get(block_index)
        if i is None:
            raise ValueError(f"{delta.get('type')} outside a thinking block")
        key = "thinking" if delta.get("type") == "thinking_delta" else "signature"
        piece = _string(delta, key)
        return [{"index": i, "type": "thinking", key: piece}] if piece else None


class ThinkingAccumulator:
    """Feeds on ``delta.thinking_blocks`` items; :meth:`blocks` gives the message's blocks."""

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: dict[int, JSONObject] = {}

    def feed(self, items: list[JSONObject]) -> None:
        for d in items:
            block = self._blocks.setdefault(int(d.get("index", 0)), {"type": d.get("type", "thinking")})
            if block["type"] == "redacted_thinking":
                block["data"] = block.get("data", "") + str(d.get("data") or "")
                continue
            block["thinking"] = block.get("thinking", "") + str(d.get("thinking") or "")
            if d.get("signature"):
                block["signature"] = block.get("signature", "") + str(d["signature"])

    def blocks(self) -> list[JSONObject] | None:
        return [self._blocks[i] for i in sorted(self._blocks)] if self._blocks else None
