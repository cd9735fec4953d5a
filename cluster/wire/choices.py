"""``n`` > 1: several choices of one request as OpenAI frames them. Pure.

A backend's chunks each carry their choice's ``index`` (vLLM streams its ``n`` child requests'
outputs interleaved, an OpenAI-compatible provider its choices' deltas); a chunk's
``finish_reason`` is its choice's. Streamed, every event holds one choice with its ``index``, and
each choice opens with its own role delta and ends with its own ``finish_reason``, as OpenAI and
vLLM's server send them. Whole, the answer's ``choices`` are the n choices in index order, each
with its text, finish reason, tool calls and logprobs. The usage is the request's: the prompt once,
the completion tokens of all choices together (OpenAI's count, and what providers bill).
"""

from __future__ import annotations

from cluster.json_types import JSONObject
from cluster.wire.logprobs import LogprobsFraming
from cluster.wire.openai_format import ResponseMeta, full_response, sse, stream_chunk
from cluster.wire.protocol import Chunk, Usage
from cluster.wire.tool_calls import ToolCallAccumulator


class _Choice:
    __slots__ = ("calls", "finish", "logprobs", "parts", "sent_first")

    def __init__(self, kind: str, collect: bool) -> None:
        self.parts: list[str] = []
        self.finish: str | None = None
        self.sent_first = False
        self.logprobs = LogprobsFraming(kind, collect)
        self.calls = ToolCallAccumulator()


class ChoiceEvents:
    """One stream's chunks of ``n`` choices as the client's events; with ``collect`` the whole
    answer's choices too (:meth:`whole`). ``continued``: the client already has each choice's
    role delta."""

    def __init__(self, meta: ResponseMeta, n: int, collect: bool, continued: bool = False) -> None:
        self.meta, self.n, self.collect = meta, n, collect
        self.choices = [_Choice(meta.kind, collect) for _ in range(n)]
        for c in self.choices:
            c.sent_first = continued

    def event(self, chunk: Chunk) -> bytes:
        """The chunk's event (``b""``: nothing to say yet; its logprobs wait for the next)."""
        if not 0 <= chunk.index < self.n:
            raise ValueError(f"choice index {chunk.index} is outside n={self.n}")
        c = self.choices[chunk.index]
        c.logprobs.add(chunk.logprobs)
        finish = None
        if c.finish is None and chunk.finish_reason is not None:  # a choice finishes once
            c.finish = chunk.finish_reason
            finish = chunk.finish_reason if chunk.finish_reason != "abort" else None
        if self.collect:
            c.parts.append(chunk.text)
            if chunk.tool_calls:
                c.calls.feed(chunk.tool_calls)
        if not (chunk.text or chunk.tool_calls or finish or not c.sent_first):
            return b""
        obj = stream_chunk(
            self.meta, chunk.text, finish, not c.sent_first, chunk.tool_calls, logprobs=c.logprobs.take()
        )
        obj["choices"][0]["index"] = chunk.index
        c.sent_first = True
        return sse(obj)

    @property
    def finish_reason(self) -> str:
        """The request's: ``length`` when any choice was cut, else the first choice's."""
        reasons = [c.finish for c in self.choices if c.finish is not None]
        if "length" in reasons:
            return "length"
        return reasons[0] if reasons else "stop"

    def whole(self) -> list[JSONObject]:
        """The choices as the end frame carries them (collecting): index order."""
        return [
            {
                "text": "".join(c.parts),
                "finish_reason": c.finish or "stop",
                "tool_calls": c.calls.calls(),
                "logprobs": c.logprobs.whole(),
            }
            for c in self.choices
        ]


def whole_response(meta: ResponseMeta, choices: list[JSONObject], usage: Usage) -> JSONObject:
    """The whole answer of ``n`` choices (each as :meth:`ChoiceEvents.whole` gives it)."""
    out: JSONObject = {}
    for i, c in enumerate(choices):
        body = full_response(
            meta, c.get("text") or "", c.get("finish_reason") or "stop", usage, c.get("tool_calls") or None,
            logprobs=c.get("logprobs"),
        )  # fmt: skip
        body["choices"][0]["index"] = i
        if not out:
            out = body
        else:
            out["choices"].append(body["choices"][0])
    return out
