"""Our Anthropic-compatible ``POST /v1/messages``: an Anthropic Messages request as the OpenAI chat
request the gateway serves, and the answer back as a Messages response. Pure.

So an Anthropic-native agent runs through the same admission, affinity, failover and relay as
chat completions, on any backend kind. Translated: ``system`` (a string or text blocks), text and
image blocks, ``tool_use`` / ``tool_result`` blocks, ``tools``, ``tool_choice`` (with
``disable_parallel_tool_use``), ``stop_sequences``, ``temperature``, ``top_p``, ``metadata.user_id``,
``stream``, ``cache_control`` on text blocks (kept on the chat text part, so it reaches an
Anthropic backend on its block), and ``thinking`` with the assistant turns' ``thinking`` /
``redacted_thinking`` blocks (passed as they are, signatures included: :mod:`cluster.wire.thinking`).
Other backends refuse the last two by the capability table, and a route narrows to those that take
them. Refused with a 400 naming the field, never dropped: ``top_k`` (no OpenAI counterpart),
``cache_control`` on tools, images and tool results, documents and server tools.
"""

from __future__ import annotations

import json

from cluster.json_types import JSON, JSONObject
from cluster.wire.errors import InvalidRequest
from cluster.wire.thinking import KINDS as THINKING

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}
_KNOWN = {
    "model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "tools",
    "tool_choice", "metadata", "stream", "thinking",
}  # fmt: skip
_REFUSED = {
    "top_k": "'top_k' has no OpenAI counterpart",
    "service_tier": "'service_tier' is not served on /v1/messages",
    "container": "'container' (code execution) is not served",
    "mcp_servers": "'mcp_servers' is not served",
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


_TYPES: dict[str, tuple[type, ...]] = {
    "messages": (list,),
    "system": (str, list),
    "stop_sequences": (list,),
    "tools": (list,),
    "tool_choice": (dict,),
    "metadata": (dict,),
    "thinking": (dict,),
}


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def check_types(body: JSONObject, types: dict[str, tuple[type, ...]]) -> None:
    """The top-level shapes a translation walks (the chat schema checks the rest afterwards)."""
    for key, allowed in types.items():
        if body.get(key) is not None and not isinstance(body[key], allowed):
            names = " or ".join(
                "object" if t is dict else "array" if t is list else "string" for t in allowed
            )
            raise _bad(f"{key}: Input should be a valid {names}", key)


def to_chat(body: JSON) -> JSONObject:
    """A Messages request body as an OpenAI chat completions body (validated by the gateway next)."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", "body")
    for key in body:
        if key in _REFUSED:
            raise _bad(f"{_REFUSED[key]}: remove '{key}' to use this endpoint.", key)
        if key not in _KNOWN:
            raise _bad(f"{key}: Extra inputs are not permitted", key)
    check_types(body, _TYPES)
    if body.get("max_tokens") is None:
        raise _bad("max_tokens: Field required", "max_tokens")
    max_tokens = body["max_tokens"]
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        max_tokens = int(max_tokens)  # 1024.0 is an integer in JSON (and to the API's validation)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _bad("max_tokens: Input should be a valid integer", "max_tokens")
    out: JSONObject = {"model": body.get("model"), "max_tokens": max_tokens}
    messages: list[JSONObject] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _system(system)})
    for i, m in enumerate(body.get("messages") or []):
        messages.extend(_message(m, i))
    out["messages"] = messages
    for a, b in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(a) is not None:
            out[b] = body[a]
    user = (body.get("metadata") or {}).get("user_id")
    if user:
        out["user"] = user
    if body.get("tools"):
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    out.update(_tool_choice(body.get("tool_choice")))
    if body.get("thinking") is not None:
        out["thinking"] = body["thinking"]  # as sent: only Anthropic backends take it
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # message_delta carries the usage
    return out


COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})


def count_tokens_to_chat(body: JSON) -> JSONObject:
    """A ``/v1/messages/count_tokens`` body as the chat body its Messages request would become (a
    placeholder ``max_tokens``, which counts nothing): the same translation, so the same tokens."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", "body")
    for key in body:
        if key not in COUNT_FIELDS and key not in _REFUSED:
            raise _bad(f"{key}: Extra inputs are not permitted", key)
    return to_chat({**body, "max_tokens": 1})


def _text_only(content: JSON, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: Input should be a valid string or list", where)
    parts = []
    for b in content:
        _no_cache_control(b, where)
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _bad(f"{where}: only text blocks are allowed here", where)
        parts.append(str(b.get("text", "")))
    return "\n\n".join(parts)


def _no_cache_control(block: JSON, where: str) -> None:
    if isinstance(block, dict) and "cache_control" in block:
        kind = block.get("type") or "tool"
        msg = f"{where}: 'cache_control' on a {kind} block is not served (only on text blocks)"
        raise _bad(msg, where.split(".", 1)[0])


def _system(system: JSON) -> JSON:
    """The system prompt: a string, or text parts when a block holds a ``cache_control`` breakpoint
    (the chat shape keeps it on its part, and the route narrows to backends that honour it)."""
    if not isinstance(system, list) or not any(isinstance(b, dict) and "cache_control" in b for b in system):
        return _text_only(system, "system")
    return [_text_part(b, "system") for b in system]


def _text_part(b: JSON, where: str) -> JSONObject:
    if not isinstance(b, dict) or b.get("type") != "text":
        raise _bad(f"{where}: only text blocks are allowed here", where)
    part: JSONObject = {"type": "text", "text": str(b.get("text", ""))}
    if "cache_control" in b:
        part["cache_control"] = b["cache_control"]
    return part


def _message(m: JSON, i: int) -> list[JSONObject]:
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{where}.role: Input should be 'user' or 'assistant'", "messages")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: Field required", "messages")
    tool_results: list[JSONObject] = []
    parts: list[JSONObject] = []
    calls: list[JSONObject] = []
    thinking: list[JSONObject] = []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            _no_cache_control(b, where)
        if kind in THINKING and m["role"] == "assistant":
            if parts or calls:  # the chat shape keeps them first, where the API puts them
                raise _bad(f"{where}: '{kind}' blocks must come first in an assistant turn", "messages")
            thinking.append(b)  # unchanged: the signature covers it
        elif kind == "text":
            parts.append(_text_part(b, where))
        elif kind == "image" and m["role"] == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b, where)}})
        elif kind == "tool_use" and m["role"] == "assistant":
            args = json.dumps(b.get("input") or {})
            calls.append(
                {
                    "id": b.get("id"),
                    "type": "function",
                    "function": {"name": b.get("name"), "arguments": args},
                }
            )
        elif kind == "tool_result" and m["role"] == "user":
            if b.get("is_error"):
                raise _bad(f"{where}: tool_result 'is_error' has no OpenAI counterpart", "messages")
            text = _text_only(b.get("content") or "", where)
            tool_results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise _bad(f"{where}: content blocks of type '{kind}' are not served on /v1/messages", "messages")
    out: list[JSONObject] = list(tool_results)
    if m["role"] == "assistant":
        msg: JSONObject = {"role": "assistant", "content": _joined(parts) if parts else None}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["thinking_blocks"] = thinking
        out.append(msg)
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


def _joined(parts: list[JSONObject]) -> JSON:
    if any("cache_control" in p for p in parts):
        return parts  # a breakpoint in an assistant turn stays on its part
    return "".join(p["text"] for p in parts)


def _image_url(b: JSONObject, where: str) -> str:
    src = b["source"] if isinstance(b.get("source"), dict) else {}
    if src.get("type") == "base64":
        return f"data:{src.get('media_type')};base64,{src.get('data')}"
    if src.get("type") == "url":
        return str(src.get("url"))
    raise _bad(f"{where}: image source type '{src.get('type')}' is not served", "messages")


def _tool(t: JSON, i: int) -> JSONObject:
    if not isinstance(t, dict) or t.get("type") not in (None, "custom") or "name" not in t:
        raise _bad(f"tools.{i}: only custom (client) tools are served on /v1/messages", "tools")
    _no_cache_control(t, f"tools.{i}")
    fn: JSONObject = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(tc: JSON) -> JSONObject:
    if tc is None:
        return {}
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice: Input tag does not match any of the expected tags", "tool_choice")
    out: JSONObject = {}
    if tc["type"] == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc["type"]]
    if tc.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def usage(u: JSONObject | None) -> JSONObject:
    """OpenAI usage as Anthropic's: ``input_tokens`` are the prompt tokens neither read from nor
    written to a prompt cache."""
    u = u or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    written = int(u.get("cache_creation_input_tokens") or 0)
    return {
        "input_tokens": max(int(u.get("prompt_tokens") or 0) - cached - written, 0),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": int(u.get("completion_tokens") or 0),
    }


def from_chat(resp: JSONObject, model: str) -> JSONObject:
    """A chat completion as a Messages response."""
    choice = (resp.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[JSONObject] = list(msg.get("thinking_blocks") or [])
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append(
            {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": _input(fn)}
        )
    return {
        "id": "msg_" + str(resp.get("id", "")).removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": usage(resp.get("usage")),
    }


def _input(fn: JSONObject) -> JSON:
    try:
        return json.loads(fn.get("arguments") or "{}")
    except ValueError:
        return {}


def error_body(status: int, openai_error: JSON) -> JSONObject:
    """An OpenAI error object as Anthropic's ``{"type": "error", "error": {...}}``."""
    err = openai_error.get("error") if isinstance(openai_error, dict) else None
    message = err.get("message") if isinstance(err, dict) else str(openai_error)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
