"""OpenAI chat messages and tools <-> Anthropic Messages content blocks. Pure.

Requests: ``tools[].function`` becomes ``{name, description, input_schema}``; ``tool_choice``
``auto`` / ``required`` / ``none`` / a named function becomes ``{"type": "auto" | "any" | "none"
| "tool"}``, and ``parallel_tool_calls: false`` becomes ``disable_parallel_tool_use``. An assistant
message's ``tool_calls`` become ``tool_use`` blocks (arguments parsed back into the ``input``
object); ``role: tool`` messages become ``tool_result`` blocks of one user turn, first in it, as the
API requires. Consecutive turns of one role are merged (Messages turns alternate). Image parts
become image blocks (a data: URL as base64, an http(s) URL as a url source); a text part's
``cache_control`` breakpoint stays on its block (and the system prompt becomes blocks to keep one).

Responses: ``tool_use`` blocks become ``tool_calls`` (``input`` serialized as the arguments
string); in a stream, ``content_block_start`` of a ``tool_use`` opens a call (id, name) and each
``input_json_delta`` adds its ``partial_json`` to the arguments, indexed among the tool calls (not
among content blocks, as OpenAI's ``index`` counts).
"""

from __future__ import annotations

import json

from cluster.json_types import JSON, JSONObject
from cluster.tokens import content_text
from cluster.wire.errors import InvalidRequest


def tools(openai_tools: list[JSONObject]) -> list[JSONObject]:
    out = []
    for t in openai_tools:
        fn = t["function"]
        tool: JSONObject = {
            "name": fn["name"],
            "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
        }
        if fn.get("description"):
            tool["description"] = fn["description"]
        out.append(tool)
    return out


def tool_choice(choice: JSON, parallel: bool | None) -> JSONObject | None:
    """OpenAI's tool_choice (and parallel_tool_calls) as Anthropic's; None when neither was sent."""
    if choice is None and parallel is None:
        return None
    if isinstance(choice, dict):
        out: JSONObject = {"type": "tool", "name": choice["function"]["name"]}
    else:
        out = {"type": {"required": "any", "none": "none"}.get(choice or "auto", "auto")}
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


def _arguments(call: JSONObject) -> JSONObject:
    raw = call["function"].get("arguments") or "{}"
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(
            f"tool call '{call['id']}': 'arguments' is not valid JSON; Anthropic needs an object",
            param="messages",
        ) from exc
    if not isinstance(value, dict):
        raise InvalidRequest(f"tool call '{call['id']}': 'arguments' must be a JSON object", param="messages")
    return value


def _image(part: JSONObject) -> JSONObject:
    url = str((part.get("image_url") or {}).get("url") or "")
    if url.startswith("data:") and ";base64," in url:
        media, data = url[5:].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    if url.startswith(("https://", "http://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise InvalidRequest(
        "image_url: Anthropic takes a data: URL (base64) or an http(s) URL", param="messages"
    )


def _content_blocks(content: JSON) -> list[JSONObject]:
    """Text and image parts as blocks; adjacent text parts join, except at a cache breakpoint."""
    if not isinstance(content, list):
        text = content_text(content)
        return [{"type": "text", "text": text}] if text else []
    blocks: list[JSONObject] = []
    for p in content:
        if p.get("type") == "image_url":
            blocks.append(_image(p))
        elif p.get("type") == "text":
            cc = p.get("cache_control")
            last = blocks[-1] if blocks else None
            if last is not None and last["type"] == "text" and "cache_control" not in last and cc is None:
                last["text"] += p.get("text") or ""
            else:
                blocks.append(
                    {"type": "text", "text": p.get("text") or "", **({"cache_control": cc} if cc else {})}
                )
    return blocks


def _blocks(m: JSONObject) -> list[JSONObject]:
    """One OpenAI message as Anthropic content blocks."""
    if m.get("role") == "tool":
        result: JSONObject = {"type": "tool_result", "tool_use_id": m["tool_call_id"]}
        text = content_text(m.get("content"))
        if text:
            result["content"] = text
        return [result]
    # Thinking first, as the API gave it: its signature covers the exact text.
    blocks = [*(m.get("thinking_blocks") or []), *_content_blocks(m.get("content"))]
    for call in m.get("tool_calls") or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": _arguments(call),
            }
        )
    return blocks


def translate_messages(
    messages: list[JSONObject],
) -> tuple[str | list[JSONObject], list[JSONObject]]:
    """(system prompt, Messages turns) for OpenAI chat messages. The system prompt is a string, or
    text blocks when it holds a ``cache_control`` breakpoint (kept where the client put it)."""
    system: list[JSONObject] = []
    out: list[JSONObject] = []
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            system.extend(b for b in _content_blocks(m.get("content")) if b["type"] == "text" and b["text"])
            continue
        role = "assistant" if role == "assistant" else "user"
        blocks = _blocks(m) or [{"type": "text", "text": ""}]
        if out and out[-1]["role"] == role:
            _merge(out[-1]["content"], blocks)
        else:
            out.append({"role": role, "content": blocks})
    if any("cache_control" in b for b in system):
        return system, out
    return "\n\n".join(b["text"] for b in system), out


def _merge(into: list[JSONObject], blocks: list[JSONObject]) -> None:
    """Adds a message's blocks to the turn before it: tool results stay first, text runs join."""
    for b in blocks:
        if b["type"] == "tool_result":
            at = sum(1 for x in into if x["type"] == "tool_result")
            into.insert(at, b)
        elif b["type"] == "text" and into and into[-1]["type"] == "text" and not _breakpoint(b, into[-1]):
            into[-1]["text"] = (into[-1]["text"] + "\n\n" + b["text"]) if into[-1]["text"] else b["text"]
        else:
            into.append(b)


def _breakpoint(*blocks: JSONObject) -> bool:
    return any("cache_control" in b for b in blocks)


def response_tool_calls(content: list[JSONObject]) -> list[JSONObject] | None:
    """A non-streaming message's ``tool_use`` blocks as OpenAI ``tool_calls``."""
    calls = [
        {
            "id": b["id"],
            "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})},
        }
        for b in content
        if b.get("type") == "tool_use"
    ]
    return calls or None


class ToolStream:
    """Stream state for tool calls: which content block is which tool call."""

    __slots__ = ("_index",)

    def __init__(self) -> None:
        self._index: dict[int, int] = {}  # content block index -> tool call index

    def start(self, block_index: int, block: JSONObject) -> list[JSONObject] | None:
        if block.get("type") != "tool_use":
            return None
        i = self._index[block_index] = len(self._index)
        fn = {"name": block.get("name", ""), "arguments": ""}
        return [{"index": i, "id": block.get("id", ""), "type": "function", "function": fn}]

    def delta(self, block_index: int, partial_json: str) -> list[JSONObject] | None:
        i = self._index.get(block_index)
        if i is None:
            raise ValueError("input_json_delta outside a tool_use block")
        return [{"index": i, "function": {"arguments": partial_json}}] if partial_json else None
