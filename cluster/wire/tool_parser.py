"""Generated text → OpenAI ``tool_calls``, incrementally. Pure: no I/O, no Ray.

A self-hosted engine writes tool calls as text; these parsers turn that text, fed in pieces of
any size, into two kinds of output items: content text (``str``) and ``delta.tool_calls`` items
(``dict``: ``index``, on a call's first item ``id``, ``type`` and ``function.name``, then
``function.arguments`` pieces). Feeding a text whole or cut anywhere gives the same content and
the same calls once :meth:`finish` is called (``tests/unit/test_tool_parser.py`` checks it with
hypothesis): a parser holds back only what the next piece could still change.

* :class:`HermesParser` (``tool_choice: auto``): the Hermes format the tool-aware chat template
  teaches, ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``; text outside calls is
  content. A call's arguments stream as they are written once its name is known. A block whose
  text turns out not to be a call (no ``name`` / ``arguments``) goes back to the content as written.
* :class:`NamedParser` (a named ``tool_choice``): the whole text is that function's arguments
  (structured decoding held the engine to its parameters' schema).
* :class:`CallListParser` (``tool_choice: required``): the text is a JSON list of
  ``{"name", "arguments"}`` objects (structured decoding held it to :mod:`cluster.wire.tool_schema`'s
  schema); each call is given whole when its object closes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from cluster.json_types import JSON, JSONObject

Item = str | JSONObject  # content text, or one ``delta.tool_calls`` item
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still close a call's object and its block: whitespace, one "}", whitespace, "</tool_call>".
_TAIL = re.compile(r"\s*(\}\s*)?$")


def call_id(request_id: str, index: int) -> str:
    return f"call_{request_id[-20:]}_{index}"


def _partial_suffix(text: str, token: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def _tail_start(body: str, start: int) -> int:
    """Where the held tail of an open call's text starts (at ``start`` or later): the text from
    there on could still be the closing ``}`` of the call's object, whitespace, or the start of
    ``</tool_call>``."""
    end = len(body) - _partial_suffix(body, CLOSE)
    m = _TAIL.search(body, min(start, end), end)
    assert m is not None  # the pattern matches the empty string
    return m.start()


class _Calls:
    """The calls found so far: numbering, ids and the header item."""

    def __init__(self, new_id: Callable[[int], str]) -> None:
        self.new_id = new_id
        self.count = 0

    def header(self, name: str, arguments: str = "") -> JSONObject:
        index, self.count = self.count, self.count + 1
        fn = {"name": name, "arguments": arguments}
        return {"index": index, "id": self.new_id(index), "type": "function", "function": fn}

    def args(self, piece: str) -> JSONObject:
        return {"index": self.count - 1, "function": {"arguments": piece}}


class HermesParser:
    """``<tool_call>{"name": .., "arguments": ..}</tool_call>`` blocks among content text."""

    def __init__(self, new_id: Callable[[int], str], max_calls: int | None = None) -> None:
        self.calls = _Calls(new_id)
        self.max_calls = max_calls  # later blocks stay content (the engine is told to stop first)
        self.buf = ""  # outside a call: held text; inside: the block's text after OPEN
        self.inside = False
        self.sent = 0  # inside, with a header: how much of buf went out as arguments
        self.header_end = 0  # inside: where the arguments start in buf (0: no header yet)

    def feed(self, text: str) -> list[Item]:
        self.buf += text
        out: list[Item] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Item]) -> bool:
        """One state change; False when the buffer needs more text."""
        if not self.inside:
            at = self.buf.find(OPEN)
            if at < 0 or (self.max_calls is not None and self.calls.count >= self.max_calls):
                keep = _partial_suffix(self.buf, OPEN) if at < 0 else 0
                _text(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return False
            _text(out, self.buf[:at])
            self.buf, self.inside, self.sent, self.header_end = self.buf[at + len(OPEN) :], True, 0, 0
            return True
        close = self.buf.find(CLOSE)
        if not self.header_end:
            m = _HEADER.match(self.buf)
            if m is None:
                if close < 0:
                    return False
                self._close_headerless(out, close)
                return True
            out.append(self.calls.header(m.group(1)))
            self.header_end = self.sent = m.end()
        if close >= 0:
            body = self.buf[:close]
            _args(out, self.calls, body[self.sent : _strip_close(body, self.sent)])
            self.buf, self.inside = self.buf[close + len(CLOSE) :], False
            return True
        stop = _tail_start(self.buf, self.sent)
        if stop > self.sent:
            _args(out, self.calls, self.buf[self.sent : stop])
            self.sent = stop
        return False

    def _close_headerless(self, out: list[Item], close: int) -> None:
        """A whole block without the header: a call if it is a JSON object with both keys (written
        in another order), else content as written."""
        body = self.buf[:close]
        self.buf, self.inside = self.buf[close + len(CLOSE) :], False
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
            out.append(self.calls.header(obj["name"], _dumps(obj["arguments"])))
        else:
            _text(out, OPEN + body + CLOSE)

    def finish(self) -> list[Item]:
        """The stream ended (a stop string may have eaten ``</tool_call>``): close what is open."""
        out: list[Item] = []
        if self.inside:
            self.buf += CLOSE
            while self._step(out):
                pass
        if self.buf:
            _text(out, self.buf)
            self.buf = ""
        return out


def _strip_close(body: str, start: int) -> int:
    """The end of a closed call's arguments: before the object's own ``}`` and whitespace."""
    m = _TAIL.search(body, start)
    assert m is not None
    return m.start()


class NamedParser:
    """The whole text is the arguments of the one function the request named."""

    def __init__(self, new_id: Callable[[int], str], name: str) -> None:
        self.calls = _Calls(new_id)
        self.name = name

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        if not self.calls.count:
            out.append(self.calls.header(self.name))
        _args(out, self.calls, text)
        return out

    def finish(self) -> list[Item]:
        return [] if self.calls.count else [self.calls.header(self.name)]


class CallListParser:
    """A JSON list of ``{"name", "arguments"}`` objects; each call whole when its object closes."""

    def __init__(self, new_id: Callable[[int], str]) -> None:
        self.calls = _Calls(new_id)
        self.depth = 0
        self.in_string = self.escaped = False
        self.element: list[str] = []  # the open element's text (depth >= 2, or its closing brace)

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        for ch in text:
            self._char(ch, out)
        return out

    def _char(self, ch: str, out: list[Item]) -> None:
        if self.depth >= 2 or (self.depth == 1 and ch == "{" and not self.in_string):
            self.element.append(ch)
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
            if self.depth == 1 and self.element:
                self._element_done(out)

    def _element_done(self, out: list[Item]) -> None:
        text, self.element = "".join(self.element), []
        try:
            obj = json.loads(text)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            out.append(self.calls.header(obj["name"], _dumps(obj.get("arguments", {}))))

    def finish(self) -> list[Item]:
        return []


Parser = HermesParser | NamedParser | CallListParser


def _dumps(value: JSON) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text(out: list[Item], text: str) -> None:
    if text:
        out.append(text)


def _args(out: list[Item], calls: _Calls, piece: str) -> None:
    if not piece:
        return
    last = out[-1] if out else None
    if isinstance(last, dict) and last["index"] == calls.count - 1:
        last["function"]["arguments"] += piece  # the call's header (or last piece) in this batch
    else:
        out.append(calls.args(piece))


def collect(items: list[Item]) -> tuple[str, list[JSONObject]]:
    """Content and whole calls (the message's ``tool_calls``) from a parser's items."""
    text: list[str] = []
    calls: dict[int, JSONObject] = {}
    for it in items:
        if isinstance(it, str):
            text.append(it)
            continue
        call = calls.setdefault(
            it["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if "id" in it:
            call["id"] = it["id"]
            call["function"]["name"] = it["function"]["name"]
        call["function"]["arguments"] += it["function"].get("arguments", "")
    return "".join(text), [calls[i] for i in sorted(calls)]


def make_parser(spec: JSONObject, request_id: str) -> Parser:
    """The parser a request's ``tool_parse`` (:class:`cluster.wire.tool_schema.ToolPlan`) names."""

    def new_id(index: int) -> str:
        return call_id(request_id, index)

    if spec["mode"] == "named":
        return NamedParser(new_id, spec["name"])
    if spec["mode"] == "list":
        return CallListParser(new_id)
    return HermesParser(new_id, spec.get("max_calls"))
