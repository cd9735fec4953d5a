"""The gateway's OpenAI chat stream as an Anthropic Messages stream. Pure.

Fed the SSE bytes the relay writes (``chat.completion.chunk`` events, the usage chunk, ``[DONE]``,
or a terminal error event), it writes the Messages events: ``message_start``, then per content
block ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``
for a tool call's arguments, ``thinking_delta`` and ``signature_delta`` for a thinking block, from
``delta.thinking_blocks``: :mod:`cluster.wire.thinking`) / ``content_block_stop``, then ``message_delta``
(stop reason and usage) and ``message_stop``; an error becomes ``event: error``.
"""

from __future__ import annotations

import json

from cluster.json_types import JSONObject
from cluster.providers.sse import SSEDecoder
from cluster.wire.messages_api import STOP_REASONS, usage


def _event(name: str, data: JSONObject) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class MessagesStream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.decoder = SSEDecoder()
        self.started = False
        self.block: tuple[str, int] | None = None  # (kind, our block index) of the open block
        self.blocks = 0
        self.tool_blocks: dict[int, int] = {}  # OpenAI tool call index -> our block index
        self.thinking_blocks: dict[int, int] = {}  # thinking block index -> our block index
        self.stop_reason: str | None = None
        self.usage: JSONObject | None = None
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for ev in self.decoder.feed(data):
            out.append(self._on(ev.data))
        return b"".join(out)

    def _on(self, data: str) -> bytes:
        if data.strip() == "[DONE]":
            return self._end()
        obj = json.loads(data)
        if "error" in obj:
            self.ended = True
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            return _event(
                "error", {"type": "error", "error": {"type": "api_error", "message": err.get("message")}}
            )
        out = [self._start(obj)] if not self.started else []
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            out.append(self._delta(choice.get("delta") or {}))
            if choice.get("finish_reason"):
                self.stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
        return b"".join(out)

    def _start(self, obj: JSONObject) -> bytes:
        self.started = True
        message: dict[str, object] = {
            "id": "msg_" + str(obj.get("id", "")).removeprefix("chatcmpl-"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message})

    def _open(self, kind: str, block: JSONObject) -> bytes:
        out = self._close()
        index = self.blocks
        self.blocks += 1
        self.block = (kind, index)
        return out + _event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
        )

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        index = self.block[1]
        self.block = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _delta(self, delta: JSONObject) -> bytes:
        out: list[bytes] = [self._thinking_piece(t) for t in delta.get("thinking_blocks") or []]
        text = delta.get("content")
        if text:
            if self.block is None or self.block[0] != "text":
                out.append(self._open("text", {"type": "text", "text": ""}))
            d = {"type": "text_delta", "text": text}
            out.append(
                _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": self.blocks - 1, "delta": d},
                )
            )
        for call in delta.get("tool_calls") or []:
            out.append(self._tool_piece(call))
        return b"".join(out)

    def _tool_piece(self, call: JSONObject) -> bytes:
        out = b""
        i = int(call.get("index", 0))
        fn = call.get("function") or {}
        if i not in self.tool_blocks:
            block: dict[str, object] = {
                "type": "tool_use",
                "id": call.get("id"),
                "name": fn.get("name"),
                "input": {},
            }
            out = self._open("tool", block)
            self.tool_blocks[i] = self.blocks - 1
        if fn.get("arguments"):
            d = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            ev = {"type": "content_block_delta", "index": self.tool_blocks[i], "delta": d}
            out += _event("content_block_delta", ev)
        return out

    def _thinking_piece(self, item: JSONObject) -> bytes:
        """A ``delta.thinking_blocks`` item as Anthropic's events: the block's start (a redacted
        block whole), then ``thinking_delta`` / ``signature_delta``."""
        i = int(item.get("index", 0))
        out = b""
        if i not in self.thinking_blocks:
            if item.get("type") == "redacted_thinking":
                block: JSONObject = {"type": "redacted_thinking", "data": item.get("data", "")}
            else:
                block = {"type": "thinking", "thinking": "", "signature": ""}
            out = self._open("thinking", block)
            self.thinking_blocks[i] = self.blocks - 1
        for key, kind in (("thinking", "thinking_delta"), ("signature", "signature_delta")):
            if item.get("type") == "thinking" and item.get(key):
                d = {"type": kind, key: item[key]}
                ev = {"type": "content_block_delta", "index": self.thinking_blocks[i], "delta": d}
                out += _event("content_block_delta", ev)
        return out

    def _end(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        out = [self._close()]
        delta = {"stop_reason": self.stop_reason or "end_turn", "stop_sequence": None}
        out.append(
            _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(self.usage)})
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)
