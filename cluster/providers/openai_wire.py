"""The OpenAI chat/completions wire format: request bodies from a GenerateRequest, stream chunks back.

Works for OpenAI itself and for OpenAI-compatible servers (vLLM, TGI, Together, ...). We always ask
for ``stream_options.include_usage`` so that the provider's own count, which is what it bills,
arrives in the last chunk.
"""

from __future__ import annotations

from cluster.json_types import JSON, JSONObject
from cluster.providers import StreamDelta, error_value
from cluster.wire.logprobs import from_openai
from cluster.wire.openai_format import loads
from cluster.wire.protocol import GenerateRequest, Usage

# Reasoning models refuse ``max_tokens`` and want ``max_completion_tokens`` (same meaning for us).
_MAX_COMPLETION_TOKENS_PREFIXES = ("o1", "o3", "o4", "gpt-5")


def endpoint(req: GenerateRequest) -> str:
    """Path below the provider's base URL."""
    return "/chat/completions" if req.kind == "chat" else "/completions"


def request_body(req: GenerateRequest, upstream_model: str, *, stream: bool = True) -> JSONObject:
    s = req.sampling
    body: JSONObject = {"model": upstream_model}
    if req.kind == "chat":
        body["messages"] = [_message(m) for m in req.messages or []]
        key = (
            "max_completion_tokens"
            if upstream_model.startswith(_MAX_COMPLETION_TOKENS_PREFIXES)
            else "max_tokens"
        )
    else:
        body["prompt"] = req.prompt_text or ""
        key = "max_tokens"
    body[key] = s.max_tokens
    body["temperature"] = s.temperature
    body["top_p"] = s.top_p
    if s.stop:
        body["stop"] = list(s.stop)
    if s.seed is not None:
        body["seed"] = s.seed
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.n > 1:
        body["n"] = s.n
    body.update(req.options)  # tools, tool_choice, response_format, suffix, ...: as the client sent them
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _message(m: JSONObject) -> JSONObject:
    # Pass the client's message through, minus fields some compatible servers reject when null.
    return {k: v for k, v in m.items() if v is not None}


def parse_usage(obj: JSON) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    details = obj.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=int(obj.get("prompt_tokens") or 0),
        completion_tokens=int(obj.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
    )


def parse_stream_data(data: str | bytes) -> StreamDelta:
    """One SSE ``data`` payload of a chat or text completion stream. Raises ValueError when malformed."""
    if data.strip() in ("[DONE]", b"[DONE]"):
        return StreamDelta(done=True)
    return parse_stream_obj(loads(data))


def plain_text(data: bytes) -> str | JSON:
    """The common chunk read fast: a ``str`` when ``data`` is a plain text delta (content only, no
    finish, usage, tool calls or error), else the parsed object for :func:`parse_stream_obj`
    (or None for ``[DONE]``). Raises ValueError when malformed."""
    if data == b"[DONE]":
        return None
    obj = loads(data)
    if type(obj) is not dict:  # (a JSON string must never pass for a text delta)
        raise ValueError("stream chunk is not a JSON object")
    if obj.get("usage") is None and "error" not in obj:
        choices = obj.get("choices")
        if type(choices) is list and len(choices) == 1:
            c = choices[0]
            if (
                type(c) is dict
                and c.get("finish_reason") is None
                and c.get("index", 0) == 0
                and not c.get("logprobs")
            ):
                d = c.get("delta")
                text = d.get("content") if type(d) is dict else c.get("text")
                if type(text) is str and text and (type(d) is not dict or d.get("tool_calls") is None):
                    return text
    return obj


def parse_stream_obj(obj: JSON) -> StreamDelta:
    """:func:`parse_stream_data` on a payload already read as JSON."""
    if not isinstance(obj, dict):
        raise ValueError("stream chunk is not a JSON object")
    if obj.get("error") is not None:
        err = obj["error"]
        return StreamDelta(error=err if isinstance(err, dict) else {"message": str(err)})
    out = StreamDelta(usage=parse_usage(obj.get("usage")))
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise ValueError("stream chunk has no 'choices' list")
    for choice in choices[:1]:  # one choice an event, as OpenAI streams them (n > 1: by index)
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", 0)
        if type(index) is not int or index < 0:
            raise ValueError("stream chunk choice index is not a non-negative integer")
        out.index = index
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError("stream chunk content is not a string")
        out.text = text or ""
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        if calls is not None and not isinstance(calls, list):
            raise ValueError("stream chunk tool_calls is not a list")
        out.tool_calls = calls or None
        out.finish_reason = choice.get("finish_reason")
        out.logprobs = from_openai(choice.get("logprobs"))
    return out


def parse_response(obj: JSONObject) -> tuple[str, str | None, Usage | None]:
    """A non-streaming chat or text completion: (text, finish_reason, usage)."""
    choice = (obj.get("choices") or [{}])[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text or "", choice.get("finish_reason"), parse_usage(obj.get("usage"))


def error_fields(body: bytes | JSONObject | None) -> JSONObject:
    """The ``error`` object of an OpenAI-style error body, or {} when the body is not one."""
    err = error_value(body)
    if isinstance(err, dict):
        return err
    if isinstance(err, str):
        return {"message": err}
    return {}
