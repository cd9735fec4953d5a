"""OpenAI chat <-> Anthropic Messages translation.

Requests: system and developer messages become the top-level ``system`` prompt; tools, tool calls
and tool results become tool blocks (:mod:`cluster.providers.anthropic_tools`); consecutive messages
of one role are merged (the Messages API wants user and assistant turns to alternate);
``thinking`` and assistant thinking blocks go as sent (:mod:`cluster.wire.thinking`);
``max_tokens`` is always sent (Anthropic requires it); ``stop`` becomes ``stop_sequences``;
``temperature`` and ``top_p`` are only sent when they differ from the neutral 1.0, since recent
models refuse both at once. What has no Anthropic counterpart (seed, penalties, a temperature above
1, ``response_format``, ...) never gets here: :mod:`cluster.policy.capabilities` refuses it with a 400.

Responses: ``usage.input_tokens`` counts only uncached input, so OpenAI's ``prompt_tokens`` is the
sum of input, cache-read and cache-creation tokens, with cache reads as ``cached_tokens`` and cache
writes as ``cache_creation_tokens`` (priced apart: :mod:`cluster.cost`).
"""

from __future__ import annotations

from cluster.json_types import JSON, JSONObject
from cluster.providers import StreamDelta, anthropic_tools, error_value
from cluster.wire.openai_format import loads, usage_dict
from cluster.wire.protocol import GenerateRequest, Usage
from cluster.wire.thinking import KINDS, ThinkingStream

API_VERSION = "2023-06-01"

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def finish_reason(stop_reason: str | None) -> str | None:
    if stop_reason is None:
        return None
    return FINISH_REASONS.get(stop_reason, "stop")


def request_body(req: GenerateRequest, upstream_model: str, *, stream: bool = True) -> JSONObject:
    s = req.sampling
    if req.kind == "chat":
        system, messages = anthropic_tools.translate_messages(req.messages or [])
    else:
        system, messages = "", [{"role": "user", "content": req.prompt_text or ""}]
    body: JSONObject = {"model": upstream_model, "max_tokens": s.max_tokens, "messages": messages}
    if system:
        body["system"] = system
    if s.stop:
        body["stop_sequences"] = list(s.stop)
    if s.temperature != 1.0:
        body["temperature"] = min(max(s.temperature, 0.0), 1.0)
    if s.top_p != 1.0:
        body["top_p"] = s.top_p
    opts = req.options
    if opts.get("tools"):
        body["tools"] = anthropic_tools.tools(opts["tools"])
    choice = anthropic_tools.tool_choice(opts.get("tool_choice"), opts.get("parallel_tool_calls"))
    if choice is not None:
        body["tool_choice"] = choice
    if opts.get("thinking") is not None:
        body["thinking"] = opts["thinking"]  # as the client sent it (cluster.wire.thinking)
    if stream:
        body["stream"] = True
    return body


def parse_usage(obj: JSON, base: Usage | None = None) -> Usage | None:
    """Anthropic usage -> ours. ``base`` carries message_start's numbers: message_delta's usage is
    cumulative but may hold only ``output_tokens``."""
    if not isinstance(obj, dict):
        return base
    u = Usage(**vars(base)) if base is not None else Usage()
    if any(k in obj for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")):
        read = int(obj.get("cache_read_input_tokens") or 0)
        created = int(obj.get("cache_creation_input_tokens") or 0)
        u.prompt_tokens = int(obj.get("input_tokens") or 0) + read + created
        u.cached_tokens = read
        u.cache_creation_tokens = created
    if "output_tokens" in obj:
        u.completion_tokens = int(obj.get("output_tokens") or 0)
    return u


class StreamState:
    """Turns Messages stream events into deltas; holds the usage seen so far."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.stop_reason: str | None = None
        self.tools = anthropic_tools.ToolStream()
        self.thinking = ThinkingStream()

    def on_event(self, event: str, data: str) -> StreamDelta:
        """One SSE event (name, data). Raises ValueError when the payload is malformed."""
        obj = loads(data)
        if not isinstance(obj, dict):
            raise ValueError("stream event is not a JSON object")
        kind = obj.get("type", event)
        if kind == "error" or event == "error":
            err = obj.get("error")
            return StreamDelta(error=err if isinstance(err, dict) else {"message": str(obj)})
        if kind == "message_start":
            message = obj.get("message")
            if not isinstance(message, dict):
                raise ValueError("message_start without a message")
            self.usage = parse_usage(message.get("usage"), self.usage)
            return StreamDelta()
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if not isinstance(delta, dict):
                raise ValueError("content_block_delta without a delta")
            if delta.get("type") == "text_delta":
                text = delta.get("text")
                if not isinstance(text, str):
                    raise ValueError("text_delta without text")
                return StreamDelta(text=text)
            if delta.get("type") == "input_json_delta":
                part = delta.get("partial_json")
                if not isinstance(part, str):
                    raise ValueError("input_json_delta without partial_json")
                return StreamDelta(tool_calls=self.tools.delta(int(obj.get("index", 0)), part))
            if delta.get("type") in ("thinking_delta", "signature_delta"):
                return StreamDelta(thinking=self.thinking.delta(int(obj.get("index", 0)), delta))
            return StreamDelta()  # citations and delta types added later
        if kind == "content_block_start":
            block = obj.get("content_block")
            if not isinstance(block, dict):
                raise ValueError("content_block_start without a content_block")
            index = int(obj.get("index", 0))
            return StreamDelta(
                tool_calls=self.tools.start(index, block), thinking=self.thinking.start(index, block)
            )
        if kind == "message_delta":
            delta = obj.get("delta") or {}
            self.stop_reason = delta.get("stop_reason") or self.stop_reason
            self.usage = parse_usage(obj.get("usage"), self.usage)
            return StreamDelta()
        if kind == "message_stop":
            return StreamDelta(done=True, finish_reason=finish_reason(self.stop_reason), usage=self.usage)
        return StreamDelta()  # ping, content_block_stop, and event types added later


def response_to_openai(msg: JSONObject, model: str | None = None) -> JSONObject:
    """A non-streaming Messages response as an OpenAI chat completion object."""
    content = msg.get("content") or []
    text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
    usage = parse_usage(msg.get("usage")) or Usage()
    message: JSONObject = {"role": "assistant", "content": text}
    if calls := anthropic_tools.response_tool_calls(content):
        message = {"role": "assistant", "content": text or None, "tool_calls": calls}
    if thinking := [b for b in content if b.get("type") in KINDS]:
        message["thinking_blocks"] = thinking
    return {
        "id": msg.get("id", ""),
        "object": "chat.completion",
        "created": 0,
        "model": model or msg.get("model", ""),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(msg.get("stop_reason")),
            }
        ],
        "usage": usage_dict(usage),
    }


def error_fields(body: bytes | JSONObject | None) -> JSONObject:
    """The ``error`` object of an Anthropic error body ``{"type": "error", "error": {...}}``."""
    err = error_value(body)
    return err if isinstance(err, dict) else {}
