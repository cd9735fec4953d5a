"""The request bodies our ``POST /v1/messages`` and ``POST /v1/responses`` serve, as pydantic v2 wire
schemas: what ``/openapi.json`` declares for them (clients and the fuzzing tests read it).

They describe what the translators (:mod:`cluster.wire.messages_api`, :mod:`cluster.wire.responses_api`)
accept; those still do the checking, so that a refused field keeps its own 400 saying why (``top_k``
has no OpenAI counterpart, ``store: true`` needs state). Fields they refuse are not declared here;
``tests/unit/test_native_schemas.py`` keeps the two sets of top-level fields equal.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.json_types import JSONObject


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


CacheControl = JSONObject
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # the chat schema's rule, which the translated request must meet


# -- Anthropic Messages ----------------------------------------------------------------------------
class TextBlock(_Wire):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ImageSource(_Wire):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Wire):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)
    input: JSONObject


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None


class ThinkingContent(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingContent(_Wire):
    type: Literal["redacted_thinking"]
    data: str


class ThinkingConfig(_Wire):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingContent | RedactedThinkingContent, Field(discriminator="type")
]


class UserMessage(_Wire):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(_Wire):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


MessageParam = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class AnthropicTool(_Wire):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: JSONObject


class AnthropicToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesMetadata(_Wire):
    user_id: str | None = None


class MessagesRequest(_Wire):
    """Anthropic's Messages request, as far as this gateway serves it."""

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: MessagesMetadata | None = None
    stream: bool | None = None
    thinking: ThinkingConfig | None = None


class MessageCountTokensRequest(_Wire):
    """``POST /v1/messages/count_tokens``: a Messages request's prompt fields (answered with
    ``{"input_tokens": N}``)."""

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


# -- OpenAI Responses (minimal, stateless) ---------------------------------------------------------
class InputText(_Wire):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(_Wire):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["low", "high", "auto"] | None = None


class MessageItem(_Wire):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]


class FunctionCallItem(_Wire):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)
    arguments: str


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class NamedFunction(_Wire):
    type: Literal["function"]
    name: str


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None


class ResponsesRequest(_Wire):
    """OpenAI's Responses request, as far as this stateless gateway serves it."""

    model: str = Field(min_length=1)
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = None
    stream: bool | None = None
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = None
