"""The internal HTTP stream between an engine replica and the gateway.

The gateway POSTs ``/generate`` with :func:`request_body` (the tokenized request and what the
client's SSE events must say: id, model, created). The engine answers:

* before its first token, an error: a non-200 status whose JSON body is ``{"error": to_wire(err)}``;
* otherwise status 200 and the client's own SSE events (``data: {chat.completion.chunk}``), one per
  token or batch of tokens, which the gateway passes through as bytes without parsing them;
* then exactly one control frame, an SSE comment that ends the stream: ``: llmc end {json}`` with
  the finish reason, usage and (when the gateway asked to collect) the whole text, the tool
  calls and the logprobs, or with ``n`` > 1 each choice's, or
  ``: llmc error {json}`` with a typed error after tokens went out.

SSE clients ignore comment lines, and JSON text never holds a raw newline, so a control frame is
found with one ``bytes.find`` per read and can never be confused with generated text.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from cluster.json_types import JSON, JSONObject
from cluster.wire.errors import ClusterError, from_wire, to_wire
from cluster.wire.openai_format import ResponseMeta
from cluster.wire.protocol import GenerateRequest, Sampling, Usage

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

CONTROL = b": llmc "
INTERNAL_TOKEN_HEADER = "x-llmc-internal"


def request_body(
    req: GenerateRequest, meta: ResponseMeta, collect: bool, *, ids: bool = False, continued: bool = False
) -> JSONObject:
    """``ids``: each event also names the token ids it carries (an :data:`IDS` comment line), so
    the gateway can continue the stream elsewhere if it breaks; ``continued``: this attempt
    continues a stream the client already has (no second role delta)."""
    r = _fields(req)
    r["sampling"] = _fields(req.sampling)
    body = {"req": r, "meta": _fields(meta), "collect": collect}
    if ids and req.sampling.n == 1:  # n > 1: choices interleave, never migrated (policy.migration)
        body["ids"] = True
    if continued:
        body["continued"] = True
    return body


def _fields(obj: DataclassInstance) -> JSONObject:
    """A dataclass's fields as a dict, one level deep. ``dataclasses.asdict`` copies every list
    element by element: with 400-token prompts it was 2 % of a gateway's CPU under load (py-spy,
    vLLM-CPU at 16 streams). The values are only serialized, never changed."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def parse_request(body: JSONObject) -> tuple[GenerateRequest, ResponseMeta, bool]:
    """The engine's side of :func:`request_body` (raises KeyError/TypeError on a bad body)."""
    r = dict(body["req"])
    r["sampling"] = Sampling(**r["sampling"])
    return GenerateRequest(**r), ResponseMeta(**body["meta"]), bool(body.get("collect", False))


def parse_flags(body: JSONObject) -> tuple[bool, bool]:
    """(ids, continued) from :func:`request_body`."""
    return bool(body.get("ids", False)), bool(body.get("continued", False))


IDS = b": ids "  # an SSE comment line in an event: the token ids whose text the event carries
_IDS_LINE = re.compile(rb"^: ids [0-9,]*\n", re.MULTILINE)


def strip_ids(events: bytes) -> bytes:
    """Whole SSE events without their :data:`IDS` lines: the gateway keeps the ids (to continue a
    broken stream) and sends the client its events as an engine without ids would (the token ids
    and the count of tokens per event are ours, not the client's). One regex pass in C."""
    return _IDS_LINE.sub(b"", events)


def event_with_ids(event: bytes, ids: list[int]) -> bytes:
    """An SSE event (``data: …\n\n``) with its token ids as a comment line, which SSE clients
    ignore (the official clients skip lines that start with a colon)."""
    return event[:-1] + IDS + ",".join(map(str, ids)).encode() + b"\n\n"


@dataclass
class Emitted:
    """What an engine stream sent the client, read back from its events (only when it broke)."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    events: int = 0
    finish_reason: str | None = None  # an event already carried it: the answer is complete


def parse_emitted(chunks: list[bytes]) -> Emitted:
    """The token ids, text and finish reason of the events in ``chunks`` (pass-through bytes)."""
    out = Emitted()
    for event in b"".join(chunks).split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(IDS):
                out.ids.extend(int(t) for t in line[len(IDS) :].split(b",") if t)
            elif line.startswith(b"data: {"):
                out.events += 1
                choices = json.loads(line[6:]).get("choices") or [{}]
                c = choices[0]
                text = c["delta"].get("content") if "delta" in c else c.get("text")
                if text:
                    out.text.append(text)
                if c.get("finish_reason"):
                    out.finish_reason = c["finish_reason"]
    return out


def control_frame(kind: str, payload: JSONObject) -> bytes:
    return CONTROL + kind.encode() + b" " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def end_frame(
    finish_reason: str,
    usage: Usage,
    text: str | None = None,
    replica: str = "",
    tool_calls: list[JSONObject] | None = None,
    logprobs: JSONObject | None = None,
    choices: list[JSONObject] | None = None,
    prompt_logprobs: list[JSON] | None = None,
) -> bytes:
    payload: JSONObject = {"finish_reason": finish_reason, "usage": asdict(usage), "replica": replica}
    if text is not None:
        payload["text"] = text
    if tool_calls:
        payload["tool_calls"] = tool_calls
    if logprobs is not None:
        payload["logprobs"] = logprobs
    if choices is not None:
        payload["choices"] = choices
    if prompt_logprobs is not None:
        payload["prompt_logprobs"] = prompt_logprobs
    return control_frame("end", payload)


def error_frame(err: ClusterError) -> bytes:
    return control_frame("error", to_wire(err))


@dataclass
class StreamEnd:
    """What the engine's control frame said."""

    finish_reason: str = "stop"
    usage: Usage = field(default_factory=Usage)
    text: str | None = None
    replica: str = ""
    error: ClusterError | None = None
    tool_calls: list[JSONObject] | None = None  # the message's, when the gateway collects
    logprobs: JSONObject | None = None  # the choice's, when the gateway collects and they were asked
    choices: list[JSONObject] | None = None  # n > 1, collecting: each choice (cluster.wire.choices)
    prompt_logprobs: list[JSON] | None = None  # asked for (never streamed): vLLM's shape


def parse_control(frame: bytes) -> StreamEnd:
    kind, _, data = frame[len(CONTROL) :].partition(b" ")
    payload = json.loads(data)
    if kind == b"error":
        return StreamEnd(error=from_wire(payload))
    return StreamEnd(
        finish_reason=payload.get("finish_reason") or "stop",
        usage=Usage(**payload.get("usage", {})),
        text=payload.get("text"),
        replica=payload.get("replica", ""),
        tool_calls=payload.get("tool_calls"),
        logprobs=payload.get("logprobs"),
        choices=payload.get("choices"),
        prompt_logprobs=payload.get("prompt_logprobs"),
    )


class FrameSplitter:
    """Cuts an engine stream into pass-through bytes (whole SSE events only) and its end frame."""

    __slots__ = ("carry", "end")

    def __init__(self) -> None:
        self.carry = b""
        self.end: StreamEnd | None = None

    def feed(self, data: bytes) -> bytes:
        """The complete events in ``carry + data`` that go to the client; sets ``end`` when the
        control frame has arrived whole."""
        buf = self.carry + data if self.carry else data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.carry = buf
            return b""
        complete, self.carry = buf[: cut + 2], buf[cut + 2 :]
        if complete.startswith(CONTROL):
            i = 0
        else:
            i = complete.find(b"\n" + CONTROL)
            if i < 0:
                return complete
            i += 1
        self.end = parse_control(complete[i:].rstrip(b"\n"))
        return complete[:i]
