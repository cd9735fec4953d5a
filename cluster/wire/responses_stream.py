"""The gateway's OpenAI chat stream as Responses API stream events. Pure.

Events, each with a ``sequence_number``: ``response.created``, ``response.in_progress``; for text
``response.output_item.added`` (a message), ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for each function call ``response.output_item.added`` (a
function_call), ``response.function_call_arguments.delta``..., ``.done``,
``response.output_item.done``; then ``response.completed`` (or ``response.incomplete`` at the
token limit, ``response.failed`` on a terminal error) with the whole response.
"""

from __future__ import annotations

import json

from cluster.json_types import JSON, JSONObject
from cluster.providers.sse import SSEDecoder
from cluster.wire import responses_api as R


class ResponsesStream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.decoder = SSEDecoder()
        self.seq = 0
        self.rid = ""
        self.started = False
        self.open: JSONObject | None = None  # the output item being streamed
        self.output: list[JSONObject] = []
        self.calls: dict[int, int] = {}  # chat tool call index -> output index
        self.finish: str | None = None
        self.usage: JSONObject | None = None
        self.ended = False

    def _ev(self, kind: str, **data: JSON) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

    def feed(self, data: bytes) -> bytes:
        return b"".join(self._on(ev.data) for ev in self.decoder.feed(data))

    def _on(self, data: str) -> bytes:
        if self.ended:
            return b""
        if data.strip() == "[DONE]":
            return self._end("completed")
        obj = json.loads(data)
        if "error" in obj:
            return self._end("failed", obj["error"])
        out = b""
        if not self.started:
            self.started = True
            self.rid = str(obj.get("id", "")).removeprefix("chatcmpl-")
            snap = R.response(self.rid, self.model, [], None, None, status="in_progress")
            out = self._ev("response.created", response=snap) + self._ev(
                "response.in_progress", response=snap
            )
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != "message":
            out = self._close()
            item = R.message_item(self.rid, "", status="in_progress")
            item["content"] = []
            out += self._open(item)
            part = {"type": "output_text", "text": "", "annotations": []}
            out += self._ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.output),
                content_index=0,
                part=part,
            )
            item["text"] = ""
        msg = self.open
        assert msg is not None  # _open made it the open item
        msg["text"] += text
        return out + self._ev(
            "response.output_text.delta",
            item_id=msg["id"],
            output_index=len(self.output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _call(self, call: JSONObject) -> bytes:
        out = b""
        i = int(call.get("index", 0))
        fn = call.get("function") or {}
        if i not in self.calls:
            out = self._close()
            item = R.call_item(self.rid, i, call.get("id", ""), fn.get("name", ""), "", status="in_progress")
            self.calls[i] = len(self.output)
            out += self._open(item)
        if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += fn["arguments"]
            out += self._ev(
                "response.function_call_arguments.delta",
                item_id=self.open["id"],
                output_index=len(self.output),
                delta=fn["arguments"],
            )
        return out

    def _open(self, item: JSONObject) -> bytes:
        self.open = item
        return self._ev("response.output_item.added", output_index=len(self.output), item=dict(item))

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        index = len(self.output)
        if item["type"] == "message":
            text = item.pop("text", "")
            done = R.message_item(self.rid, text)
            part = done["content"][0]
            out = self._ev(
                "response.output_text.done",
                item_id=done["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            out += self._ev(
                "response.content_part.done",
                item_id=done["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        else:
            done = {**item, "status": "completed"}
            out = self._ev(
                "response.function_call_arguments.done",
                item_id=done["id"],
                output_index=index,
                arguments=done["arguments"],
            )
        self.output.append(done)
        return out + self._ev("response.output_item.done", output_index=index, item=done)

    def _end(self, status: str, error: JSON = None) -> bytes:
        self.ended = True
        out = self._close()
        snap = R.response(self.rid, self.model, self.output, self.finish, self.usage or {}, status=status)
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else str(error)
            snap["error"] = {"code": "server_error", "message": message}
        kind = {
            "completed": "response.incomplete" if snap["status"] == "incomplete" else "response.completed"
        }
        return out + self._ev(kind.get(status, "response.failed"), response=snap)
