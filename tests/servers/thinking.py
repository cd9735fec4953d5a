"""Extended thinking for the Anthropic loopback server, as Anthropic documents it.

A request with ``thinking: {"type": "enabled", "budget_tokens": N}`` (N at least 1,024 and below
``max_tokens``; ``temperature`` only 1) is answered with a ``thinking`` block first, its text
signed: the signature is this server's HMAC of the text, so a block sent back changed by a byte is
refused as the API refuses it (``Invalid `signature` in `thinking` block``). A prompt holding
Anthropic's documented test string gets a ``redacted_thinking`` block instead (its ``data`` signed
the same way). With thinking on, the last assistant turn of a tool loop must start with its
thinking block, as the API requires. Streams send the thinking as ``thinking_delta`` pieces, then
one ``signature_delta``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

MAGIC = "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING_46C9A13E193C177646C7398A98432ECCCE4C1253"
THOUGHT = "The user asks about the weather, so I should look it up before I answer."
_KEY = b"loopback-thinking-signing-key"


def sign(text: str) -> str:
    return base64.b64encode(hmac.new(_KEY, text.encode(), hashlib.sha256).digest()).decode()


def enabled(body: dict[str, Any]) -> bool:
    t = body.get("thinking")
    return isinstance(t, dict) and t.get("type") == "enabled"


def problem(body: dict[str, Any]) -> str | None:
    """The API's checks on the thinking config and on the thinking blocks sent back."""
    t = body.get("thinking")
    if t is not None:
        if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled"):
            return "thinking: Input tag does not match any of the expected tags: 'enabled', 'disabled'"
        if enabled(body):
            budget = t.get("budget_tokens")
            if not isinstance(budget, int) or budget < 1024:
                return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
            if body["max_tokens"] <= budget:
                return "`max_tokens` must be greater than `thinking.budget_tokens`"
            if body.get("temperature") not in (None, 1, 1.0):
                return "`temperature` may only be set to 1 when thinking is enabled"
    for i, m in enumerate(body["messages"]):
        for j, b in enumerate(m["content"] if isinstance(m["content"], list) else []):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "thinking" and b.get("signature") != sign(str(b.get("thinking"))):
                return f"messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
            if kind == "redacted_thinking" and not _valid_redacted(str(b.get("data"))):
                return f"messages.{i}.content.{j}: Invalid `data` in `redacted_thinking` block"
    return _final_turn_problem(body) if enabled(body) else None


def _final_turn_problem(body: dict[str, Any]) -> str | None:
    turns = body["messages"]
    last = next((i for i in range(len(turns) - 1, -1, -1) if turns[i]["role"] == "assistant"), None)
    content = turns[last]["content"] if last is not None else None
    if not isinstance(content, list) or not any(b.get("type") == "tool_use" for b in content):
        return None
    first = content[0].get("type")
    if first in ("thinking", "redacted_thinking"):
        return None
    return (
        f"messages.{last}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        f"`{first}`. When `thinking` is enabled, a final `assistant` message must start with a "
        "thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks)."
    )


def _valid_redacted(data: str) -> bool:
    nonce, _, mac = data.partition(".")
    return bool(nonce) and mac == sign(nonce)


def block(body: dict[str, Any]) -> dict[str, Any]:
    """The answer's thinking block (redacted when the prompt asks for it, as the docs' test does)."""
    if MAGIC in json.dumps(body["messages"]):
        nonce = base64.b64encode(hashlib.sha256(json.dumps(body["messages"]).encode()).digest()[:12]).decode()
        return {"type": "redacted_thinking", "data": f"{nonce}.{sign(nonce)}"}
    return {"type": "thinking", "thinking": THOUGHT, "signature": sign(THOUGHT)}
