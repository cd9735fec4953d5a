"""The wire schemas /openapi.json declares for /v1/messages and /v1/responses match what the
translators serve: the same top-level fields, the documented examples valid under both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.wire import messages_api, responses_api
from cluster.wire.native_schemas import MessagesRequest, ResponsesRequest
from cluster.wire.protocol import ChatCompletionRequest
from deployments.gateway.http_api import openapi_document

DATA = Path(__file__).parent / "data" / "tools"


def test_the_schemas_declare_exactly_the_fields_the_translators_serve() -> None:
    assert set(MessagesRequest.model_fields) == messages_api._KNOWN
    assert set(ResponsesRequest.model_fields) == responses_api._KNOWN
    assert not set(MessagesRequest.model_fields) & set(messages_api._REFUSED)


def test_a_documented_messages_request_is_valid_under_both() -> None:
    body = json.loads((DATA / "anthropic_round_trip.json").read_text())
    MessagesRequest.model_validate(body)
    assert messages_api.to_chat(body)["messages"]


def test_a_responses_request_with_a_function_call_is_valid_under_both() -> None:
    body = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "15 degrees"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    }
    ResponsesRequest.model_validate(body)
    assert responses_api.to_chat(body)["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("field", ["top_k", "container"])
def test_refused_fields_are_not_declared(field: str) -> None:
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [], field: 1})


def test_openapi_lists_the_native_routes_with_their_request_schemas() -> None:
    doc = openapi_document()
    for path, model, error in (
        ("/v1/messages", "MessagesRequest", "AnthropicError"),
        ("/v1/responses", "ResponsesRequest", "ErrorResponse"),
    ):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert post["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith(error)
        assert model in doc["components"]["schemas"]


def test_the_chat_message_schema_is_one_object_per_role() -> None:
    """What ChatMessage's validator enforces, the schema says (so a schema-valid body is valid)."""
    variants = openapi_document()["components"]["schemas"]["ChatMessage"]["oneOf"]
    by_role = {tuple(v["properties"]["role"]["enum"]): v for v in variants}
    tool = by_role[("tool",)]
    assert tool["required"] == ["role", "tool_call_id"] and "tool_calls" not in tool["properties"]
    assert "thinking_blocks" not in by_role[("system", "developer", "user")]["properties"]
    assert "tool_call_id" not in by_role[("assistant",)]["properties"]
    assert ChatCompletionRequest.model_json_schema()["dependentRequired"] == {"tool_choice": ["tools"]}


def test_an_integral_float_max_tokens_is_an_integer() -> None:
    body = {"model": "m", "max_tokens": 1024.0, "messages": [{"role": "user", "content": "hi"}]}
    assert messages_api.to_chat(body)["max_tokens"] == 1024
    MessagesRequest.model_validate(body)
