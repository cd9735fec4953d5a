"""A minimal OpenAI ``POST /v1/responses``: text and function calls, as the chat request the gateway
serves, and the answer back as a Response object. Pure.

Translated: ``input`` (a string, or message items with ``input_text`` / ``output_text`` /
``input_image`` parts, ``function_call`` and ``function_call_output`` items), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (as ``response_format``), ``user``, ``stream``. Refused
with a 400 naming the field: state kept by OpenAI (``previous_response_id``, ``conversation``,
``store: true``, ``background``), ``reasoning``, ``include``, built-in tools. Stateless: nothing is
stored, so ``store`` must be false or absent (absent is taken as false, and the response says
``store: false``).
"""

from __future__ import annotations

import time

from cluster.json_types import JSON, JSONObject
from cluster.wire.errors import InvalidRequest
from cluster.wire.messages_api import check_types

_KNOWN = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "user",
    "stream",
    "store",
    "metadata",
}


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def to_chat(body: JSON) -> JSONObject:
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", "body")
    for key in body:
        if key not in _KNOWN:
            raise _bad(f"'{key}' is not served by this gateway's /v1/responses (stateless, minimal).", key)
    check_types(body, {"input": (str, list), "tools": (list,), "tool_choice": (str, dict), "text": (dict,)})
    if isinstance((body.get("text") or {}).get("format"), list | str | int | float | bool):
        raise _bad("text.format: Input should be a valid object", "text")
    if body.get("store"):
        raise _bad("'store: true' needs server-side state, which this gateway does not keep.", "store")
    out: JSONObject = {"model": body.get("model")}
    messages: list[JSONObject] = []
    if body.get("instructions"):
        messages.append({"role": "developer", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            _item(messages, item, i)
    else:
        raise _bad("'input' must be a string or a list of items", "input")
    out["messages"] = messages
    for a, b in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
    ):
        if body.get(a) is not None:
            out[b] = body[a]
    if body.get("tools"):
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        tc = body["tool_choice"]
        out["tool_choice"] = (
            {"type": "function", "function": {"name": tc.get("name")}} if isinstance(tc, dict) else tc
        )
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    fmt = (body.get("text") or {}).get("format")
    if fmt and fmt.get("type") != "text":
        out["response_format"] = _format(fmt)
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def _format(fmt: JSONObject) -> JSONObject:
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def _item(messages: list[JSONObject], item: JSON, i: int) -> None:
    if not isinstance(item, dict):
        raise _bad(f"input[{i}] must be an object", "input")
    kind = item.get("type") or "message"  # absent or null: a message item
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _bad(f"input[{i}].role must be user, system, developer or assistant", "input")
        messages.append({"role": role, "content": _content(item.get("content"), i, role)})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
        }
        last = messages[-1] if messages else None
        if (
            last is not None
            and last["role"] == "assistant"
            and last.get("tool_calls")
            and last["content"] is None
        ):
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(
            {
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else str(output),
            }
        )
    else:
        raise _bad(f"input[{i}]: items of type '{kind}' are not served", "input")


def _content(content: JSON, i: int, role: str) -> JSON:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"input[{i}].content must be a string or a list of parts", "input")
    parts: list[JSONObject] = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": p.get("text", "")})
        elif kind == "input_image" and p.get("image_url"):
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        else:
            raise _bad(f"input[{i}]: content parts of type '{kind}' are not served", "input")
    if role == "assistant":
        return "".join(p["text"] for p in parts if p["type"] == "text")
    return parts


def _tool(t: JSON, i: int) -> JSONObject:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise _bad(f"tools[{i}]: only function tools are served (no built-in tools)", "tools")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def usage(u: JSONObject | None) -> JSONObject:
    u = u or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    written = int(u.get("cache_creation_input_tokens") or 0)
    inp, outp = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": outp,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + outp,
    }


def message_item(rid: str, text: str, status: str = "completed") -> JSONObject:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant", "content": [part]}


def call_item(
    rid: str, i: int, call_id: str, name: str, arguments: str, status: str = "completed"
) -> JSONObject:
    return {
        "type": "function_call",
        "id": f"fc_{rid}_{i}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response(
    rid: str, model: str, output: list[JSONObject], finish: str | None, u: JSON, status: str = "completed"
) -> JSONObject:
    incomplete = finish == "length"
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete and status == "completed" else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "store": False,
        "usage": usage(u) if u is not None else None,
    }


def from_chat(resp: JSONObject, model: str) -> JSONObject:
    rid = str(resp.get("id", "")).removeprefix("chatcmpl-")
    choice = (resp.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    output: list[JSONObject] = []
    if msg.get("content"):
        output.append(message_item(rid, msg["content"]))
    for i, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function") or {}
        output.append(call_item(rid, i, call.get("id", ""), fn.get("name", ""), fn.get("arguments", "")))
    return response(rid, model, output, choice.get("finish_reason"), resp.get("usage") or {})
