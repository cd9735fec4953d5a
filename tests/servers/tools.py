"""Tool calling for the loopback servers, deterministic: what a model "decides", and the checks the
real APIs make on tool requests.

A request with tools (and a tool choice other than none) whose last turn is not a tool result is
answered with tool calls: the named tool, or, when parallel calls are allowed, every tool, else the
first. Arguments are built from each tool's JSON schema (its required properties, or all of them):
strings get a fixed sample (``"San Francisco, CA"`` for a ``location``, as in both providers'
documented examples), numbers 1, booleans true, enums their first value. A request whose last turn
holds tool results is answered with text, as a model answering from the results would.
"""

from __future__ import annotations

import json
from typing import Any

ARG_PIECE = 8  # streamed arguments come in pieces of this many characters


def sample_args(schema: dict[str, Any] | None) -> dict[str, Any]:
    props = (schema or {}).get("properties") or {}
    names = (schema or {}).get("required") or list(props)
    out: dict[str, Any] = {}
    for name in names:
        p = props.get(name) or {}
        if p.get("enum"):
            out[name] = p["enum"][0]
        elif p.get("type") in ("number", "integer"):
            out[name] = 1
        elif p.get("type") == "boolean":
            out[name] = True
        else:
            out[name] = "San Francisco, CA" if name == "location" else f"{name}-value"
    return out


def pieces(text: str) -> list[str]:
    return [text[i : i + ARG_PIECE] for i in range(0, len(text), ARG_PIECE)] or [""]


def choose(
    tools: list[tuple[str, dict[str, Any] | None]], choice: str | None, parallel: bool
) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of the calls to make; ``choice`` is none/auto/any or a tool's name."""
    if not tools or choice == "none":
        return []
    if choice not in (None, "auto", "any"):
        tools = [t for t in tools if t[0] == choice]
    picked = tools if parallel else tools[:1]
    return [(name, sample_args(schema)) for name, schema in picked]


# -- Anthropic --------------------------------------------------------------------------------------


def anthropic_calls(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    tools = [(t["name"], t.get("input_schema")) for t in body.get("tools") or []]
    tc = body.get("tool_choice") or {}
    if not tools or _has(body["messages"][-1], "tool_result"):
        return []
    choice = tc.get("name") if tc.get("type") == "tool" else tc.get("type")
    return choose(tools, choice, parallel=not tc.get("disable_parallel_tool_use", False))


def _has(message: dict[str, Any], kind: str) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == kind for b in content)


def anthropic_problem(body: dict[str, Any]) -> str | None:
    """The real API's checks on tools, tool_choice, tool_use and tool_result blocks."""
    tools = body.get("tools")
    names = set()
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            return f"tools.{i}.name: Field required"
        if not isinstance(t.get("input_schema"), dict) or t["input_schema"].get("type") != "object":
            return f"tools.{i}.custom.input_schema: Input should be an object schema"
        names.add(t["name"])
    tc = body.get("tool_choice")
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
            tags = "'auto', 'any', 'tool', 'none'"
            return f"tool_choice: Input tag does not match any of the expected tags: {tags}"
        if tc["type"] == "tool" and tc.get("name") not in names:
            return f"tool_choice.name: Tool '{tc.get('name')}' not found in tools"
    previous_uses: set[str] = set()
    for i, m in enumerate(body["messages"]):
        content = m["content"] if isinstance(m["content"], list) else []
        uses = {b.get("id") for b in content if isinstance(b, dict) and b.get("type") == "tool_use"}
        if uses and m["role"] != "assistant":
            return f"messages.{i}: tool_use blocks may only appear in assistant messages"
        kinds = [b.get("type") for b in content if isinstance(b, dict)]
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        if results:
            if m["role"] != "user":
                return f"messages.{i}: tool_result blocks may only appear in user messages"
            if kinds[: len(results)] != ["tool_result"] * len(results):
                return f"messages.{i}: tool_result blocks must come FIRST in the content array"
            for r in results:
                if r.get("tool_use_id") not in previous_uses:
                    return (
                        f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` blocks: "
                        f"{r.get('tool_use_id')}. Each `tool_result` block must have a corresponding "
                        "`tool_use` block in the previous message."
                    )
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_use" and not isinstance(b.get("input"), dict):
                return f"messages.{i}: tool_use.input: Input should be a valid dictionary"
        previous_uses = uses
    return None


# -- OpenAI -----------------------------------------------------------------------------------------


def openai_calls(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    tools = [(t["function"]["name"], t["function"].get("parameters")) for t in body.get("tools") or []]
    last = body["messages"][-1]
    if not tools or not isinstance(last, dict) or last.get("role") == "tool":
        return []
    tc = body.get("tool_choice")
    choice = tc["function"]["name"] if isinstance(tc, dict) else {"required": "any"}.get(tc, tc)
    return choose(tools, choice, parallel=body.get("parallel_tool_calls", True) is not False)


def openai_tool_calls(calls: list[tuple[str, dict[str, Any]]], ids: list[str]) -> list[dict[str, Any]]:
    return [
        {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in zip(ids, calls, strict=True)
    ]
