"""Provider adapters' pure parts: wire translation, SSE parsing, error mapping and budgets.

Nothing here does I/O; ``deployments/providers/providers.py`` holds the adapters (over aiohttp) that use them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cluster.json_types import JSON, JSONObject
from cluster.wire.protocol import Usage


@dataclass(slots=True)
class StreamDelta:
    """What one provider stream event means for us, whatever the provider's wire format.

    ``done`` marks the provider's explicit end of stream (``[DONE]``, ``message_stop``): a stream
    that ends without it was cut. ``error`` holds a mid-stream error object, in the provider's shape.
    """

    text: str = ""
    tool_calls: list[JSONObject] | None = None  # OpenAI ``delta.tool_calls`` items (with index)
    thinking: list[JSONObject] | None = None  # ``delta.thinking_blocks`` items (cluster.wire.thinking)
    logprobs: list[JSONObject] | None = None  # the tokens' logprobs entries (cluster.wire.logprobs)
    finish_reason: str | None = None
    usage: Usage | None = None
    done: bool = False
    index: int = 0  # the choice (``n`` > 1: an OpenAI-compatible provider's choices interleave)
    error: JSONObject | None = None


def error_value(body: bytes | JSONObject | None) -> JSON:
    """The ``error`` member of a provider's error body (both APIs put it there), or None when the
    body is not a JSON object."""
    obj: JSON = body
    if isinstance(body, bytes | bytearray):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
    return obj.get("error") if isinstance(obj, dict) else None
