"""``POST /v1/messages/count_tokens``: its body translated as ``/v1/messages`` translates it, counted
as the gateway's prepare counts the same request's prompt, and its shell's auth and errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from cluster.config import load_config
from cluster.wire import messages_api
from cluster.wire.errors import InvalidRequest, Unauthorized
from cluster.wire.native_schemas import MessageCountTokensRequest
from cluster.wire.protocol import ChatCompletionRequest
from deployments.gateway import native_api
from deployments.gateway.prepare import count_prompt, prepare

CFG = load_config(Path(__file__).parents[2] / "configs" / "local.yaml")
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
BODY: dict[str, Any] = {
    "model": "tiny-llama",
    "system": "You are terse.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
    "tools": TOOLS,
    "tool_choice": {"type": "auto"},
}


def test_the_schema_declares_exactly_the_fields_the_translation_counts() -> None:
    assert set(MessageCountTokensRequest.model_fields) == messages_api.COUNT_FIELDS
    MessageCountTokensRequest.model_validate(BODY)


def test_the_translation_is_the_messages_one_without_sampling() -> None:
    chat = messages_api.count_tokens_to_chat(BODY)
    assert chat == messages_api.to_chat({**BODY, "max_tokens": 1})
    assert chat["messages"][0] == {"role": "system", "content": "You are terse."}
    assert chat["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("field", "says"), [("max_tokens", "Extra inputs"), ("stream", "Extra inputs"), ("top_k", "top_k")]
)
def test_fields_a_count_does_not_take_are_a_400_naming_them(field: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        messages_api.count_tokens_to_chat({**BODY, field: 1})
    assert err.value.param == field and says in str(err.value)


@pytest.mark.parametrize(
    "body",
    [
        BODY,
        {**BODY, "tools": None, "tool_choice": None},
        {**BODY, "tool_choice": {"type": "none"}},
        {
            **BODY,
            "messages": [
                *BODY["messages"],
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "15C"}]},
            ],
        },
    ],
)
def test_the_count_is_the_prompt_prepare_builds_for_the_same_messages_request(body: dict[str, Any]) -> None:
    body = {k: v for k, v in body.items() if v is not None}
    counted = count_prompt(CFG, json.dumps(messages_api.count_tokens_to_chat(body)).encode())
    raw = json.dumps(messages_api.to_chat({**body, "max_tokens": 16})).encode()
    prepared = prepare(CFG, raw, ChatCompletionRequest, "chat", "r1", "chat", None, {})
    assert counted == len(prepared.req.prompt_token_ids) > 20


def test_tools_count() -> None:
    with_tools = count_prompt(CFG, json.dumps(messages_api.count_tokens_to_chat(BODY)).encode())
    bare = {k: v for k, v in BODY.items() if k not in ("tools", "tool_choice")}
    without = count_prompt(CFG, json.dumps(messages_api.count_tokens_to_chat(bare)).encode())
    assert with_tools > without + 10


MSG = "Missing or invalid API key."


class _Http:
    """One request through the ASGI shell: what it read and what it answered."""

    def __init__(self, body: bytes) -> None:
        self.body, self.reads, self.sent = body, 0, []

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    def answer(self) -> tuple[int, Any]:
        return self.sent[0]["status"], json.loads(self.sent[1]["body"])


def _run(body: bytes, authorize: Any = lambda scope: None, limit: int = 1 << 20) -> _Http:
    http = _Http(body)
    scope = {"type": "http", "headers": [(b"content-type", b"application/json")]}

    async def count(chat: bytes) -> int:
        return count_prompt(CFG, chat)

    asyncio.run(native_api.count_tokens(count, limit, authorize, scope, http.receive, http.send))
    return http


def test_the_shell_answers_input_tokens() -> None:
    status, obj = _run(json.dumps(BODY).encode()).answer()
    expected = count_prompt(CFG, json.dumps(messages_api.count_tokens_to_chat(BODY)).encode())
    assert (status, obj) == (200, {"input_tokens": expected})


def test_a_refused_key_is_a_401_before_the_body_is_read() -> None:
    def refuse(scope: Any) -> None:
        raise Unauthorized(MSG)

    http = _run(json.dumps(BODY).encode(), refuse)
    assert http.reads == 0
    assert http.answer() == (
        401,
        {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Missing or invalid API key."},
        },
    )


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({**BODY, "model": "nope"}, 404, "not_found_error"),
        ({**BODY, "messages": "hi"}, 400, "invalid_request_error"),
        ({**BODY, "max_tokens": 5}, 400, "invalid_request_error"),
        ({**BODY, "system": "x" * 2000}, 413, "request_too_large"),
    ],
)
def test_errors_are_anthropic_shaped(body: dict[str, Any], status: int, kind: str) -> None:
    got_status, obj = _run(json.dumps(body).encode(), limit=1000).answer()
    assert (got_status, obj["type"], obj["error"]["type"]) == (status, "error", kind)


def test_openapi_declares_the_route_with_its_schema_and_anthropic_errors() -> None:
    from deployments.gateway.http_api import openapi_document

    doc = openapi_document()
    post = doc["paths"]["/v1/messages/count_tokens"]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/MessageCountTokensRequest"}
    assert post["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "AnthropicError"
    )
