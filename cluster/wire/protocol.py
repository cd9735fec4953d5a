"""Wire schemas (OpenAI-compatible requests) and the internal request/chunk types every backend speaks.

The wire models know every field of OpenAI's chat/completions and completions requests and refuse
any other (``Unrecognized request argument supplied``, as OpenAI does): a field is never dropped
in silence. Whether the chosen backend honours a known field is :mod:`cluster.policy.capabilities`' call.
Fields we only pass through to providers are typed loosely (the provider validates them); the ones
we read or translate are typed here. The internal types are plain dataclasses: cheap to build,
pickled across Ray processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue

from cluster.json_types import JSON, JSONObject

# --------------------------------------------------------------------------------------------
# Wire (OpenAI) schemas
# --------------------------------------------------------------------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Wire):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None


class ContentPart(_Wire):
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    image_url: JSONObject | None = None
    input_audio: JSONObject | None = None
    file: JSONObject | None = None
    refusal: str | None = None
    cache_control: JSONObject | None = None  # Anthropic's prompt-cache breakpoint (LiteLLM's shape)


class FunctionCall(_Wire):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(_Wire):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ThinkingBlock(BaseModel):
    """An Anthropic ``thinking`` (text + signature) or ``redacted_thinking`` (data) block. Other
    keys the API may add are kept (``extra="allow"``): the block goes back upstream as it came."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


# (roles, fields they may not carry, fields they must): ChatMessage's schema, one object per role
_ROLE_SHAPES = (
    (("system", "developer", "user"), {"tool_calls", "tool_call_id", "thinking_blocks"}, ["role"]),
    (("assistant",), {"tool_call_id"}, ["role"]),
    (("tool",), {"tool_calls", "thinking_blocks"}, ["role", "tool_call_id"]),
)


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: JSONObject | None = None
    function_call: JSONObject | None = None
    # Anthropic's thinking / redacted_thinking blocks of an assistant turn, exactly as the API gave
    # them (signatures included), to be sent back (LiteLLM's field): Anthropic backends only.
    thinking_blocks: list[ThinkingBlock] | None = None

    @classmethod
    def __get_pydantic_json_schema__(
        cls,
        core: Any,  # Any: pydantic's core schema
        handler: GetJsonSchemaHandler,
    ) -> JsonSchemaValue:
        """One object per role, as OpenAI's own spec writes the message (``_tool_fields``' rules in
        the schema), so clients and the fuzzer see which fields each role may carry."""
        ref = handler(core)
        schema = handler.resolve_ref_schema(ref)
        props, title = schema["properties"], schema.get("title")
        variants = []
        for roles, drop, required in _ROLE_SHAPES:
            shape = {k: v for k, v in props.items() if k not in drop}
            shape["role"] = {"type": "string", "enum": list(roles)}
            if "tool_call_id" in required:
                shape["tool_call_id"] = {"type": "string", "minLength": 1}
            variants.append(
                {"type": "object", "additionalProperties": False, "properties": shape, "required": required}
            )
        schema.clear()
        schema.update({"title": title, "oneOf": variants})
        return ref

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message may hold 'tool_calls'")
        if self.thinking_blocks and self.role != "assistant":
            raise ValueError("only an 'assistant' message may hold 'thinking_blocks'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class FunctionDef(_Wire):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None


class Tool(_Wire):
    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(_Wire):
    name: str = Field(min_length=1)


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: _NamedFunction


class JsonSchemaFormat(_Wire):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: JSONObject | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


def _at_least_one(v: int | None, info: ValidationInfo) -> int | None:
    """A token count the client sets must ask for at least one token."""
    if v is not None and v <= 0:
        raise ValueError(f"{info.field_name} must be at least 1")
    return v


class _SamplingFields(_Wire):
    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)  # choices (OpenAI's limit); capabilities say where
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    ignore_eos: StrictBool = False  # vLLM extension: benchmarks need exact output lengths
    logit_bias: dict[str, float] | None = None
    logprobs: JSON = None  # chat: a bool; completions: an int
    # vLLM's extension: each prompt token's logprob and this many alternatives (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    _positive = field_validator("max_tokens")(_at_least_one)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    # _tool_choice_names_a_tool's first rule, in the schema
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"dependentRequired": {"tool_choice": ["tools"]}}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    # Anthropic's extended-thinking config, passed as sent (LiteLLM's field): Anthropic backends only.
    thinking: JSONObject | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Passed through to OpenAI-compatible providers only (cluster.policy.capabilities says where).
    audio: JSON = None
    function_call: JSON = None
    functions: JSON = None
    metadata: JSON = None
    modalities: JSON = None
    prediction: JSON = None
    prompt_cache_key: JSON = None
    prompt_cache_retention: JSON = None
    reasoning_effort: JSON = None
    safety_identifier: JSON = None
    service_tier: JSON = None
    store: JSON = None
    verbosity: JSON = None
    web_search_options: JSON = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        if self.tool_choice is not None and not self.tools:
            raise ValueError("'tool_choice' is only allowed when 'tools' are specified")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names '{self.tool_choice.function.name}', which is not in 'tools'"
                )
        return self

    _positive_mct = field_validator("max_completion_tokens")(_at_least_one)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# --------------------------------------------------------------------------------------------
# Internal types
# --------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Structured decoding on self-hosted engines: {"json": schema} or {"json_object": True}
    # (vLLM's StructuredOutputsParams fields); None for free text.
    structured: JSONObject | None = None
    # Each sampled token's logprob and this many top alternatives (vLLM's ``logprobs``; None: none)
    logprobs: int | None = None
    # Choices to sample from the one prompt (OpenAI's ``n``): vLLM's ``n``, a provider's as sent
    n: int = 1
    # vLLM's ``prompt_logprobs``: the prompt tokens' logprobs with this many alternatives (None: none)
    prompt_logprobs: int | None = None


@dataclass
class GenerateRequest:
    """What the router hands a backend: tokenized once, with the original messages kept for providers."""

    request_id: str
    model: str
    kind: Literal["chat", "completion"]
    prompt_token_ids: list[int]
    sampling: Sampling
    messages: list[JSONObject] | None = None  # chat requests, for provider adapters
    prompt_text: str | None = None  # completion requests (or the rendered chat prompt)
    surface: str = "chat"
    priority: int = 0  # the surface's: the engine schedules lower numbers first (vLLM's priority policy)
    # The gateway's word on this attempt's replica: 0 its cache holds the prompt's context, 1 not
    # (cluster.routing.affinity.AffinityRouter.cache_rank); set as the attempt is routed.
    cache_rank: int = 0
    session_id: str | None = None
    # The salt of the request's tenant's cache group (cluster.routing.cache_salt; None: no tenant):
    # the engine's prefix cache (vLLM's cache_salt) and the router's block hashes both mix it in.
    cache_salt: str | None = None
    deadline: float | None = None  # epoch seconds
    attempt: int = 0  # 0 for the first try, 1.. for failovers and hedges
    exclude_replicas: list[str] = field(default_factory=list)  # a hedge or retry avoids these
    # The client's fields beyond the sampling ones (tools, tool_choice, response_format, suffix, ...)
    # as sent: provider adapters pass or translate them; capabilities refused the rest before here.
    options: JSONObject = field(default_factory=dict)
    # How a self-hosted engine reads tool calls out of its text (cluster.wire.tool_schema.ToolPlan.parse:
    # mode hermes / named / list, name, max_calls, stop); None: no tools to parse.
    tool_parse: JSONObject | None = None
    # False: the client gave no max_tokens and sampling.max_tokens is ours (the rest of the window or
    # a configured limit), so a token budget may trim its reservation (cluster.policy.context).
    max_tokens_asked: bool = True

    @property
    def engine_priority(self) -> int:
        """The engine's queue key (vLLM's ``priority``, lower first): the surface's priority, then
        within it a cached context before one that is not."""
        return 2 * self.priority + (1 if self.cache_rank else 0)

    @property
    def route_key(self) -> str:
        """One attempt of one request (a request's attempts may go to different replicas)."""
        return f"{self.request_id}/{self.attempt}"


@dataclass
class Usage:
    """Tokens as the backend counted them. ``prompt_tokens`` is the whole prompt; of it,
    ``cached_tokens`` were read from a prefix cache (vLLM's and the sim's ``num_cached_tokens``,
    OpenAI's ``prompt_tokens_details.cached_tokens``, Anthropic's ``cache_read_input_tokens``) and
    ``cache_creation_tokens`` were written to one (Anthropic's ``cache_creation_input_tokens``,
    billed above the input price; 0 elsewhere)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_creation_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Chunk:
    """A piece of a backend's answer. The last chunk has ``finish_reason`` and ``usage`` set.

    ``error`` set means the stream ended with an error (a terminal chunk); ``replica`` names who
    served it, for routing metrics and tests.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    replica: str | None = None
    backend: str | None = None
    model: str | None = None  # set by the router on a request's first chunk (a bigger-window model)
    # OpenAI ``delta.tool_calls`` items (with index); last, so positional construction keeps its order
    tool_calls: list[JSONObject] | None = None
    # ``delta.thinking_blocks`` items (with index): an Anthropic thinking block's pieces
    thinking: list[JSONObject] | None = None
    # an engine's sampled tokens' logprobs, chat-shape entries (cluster.wire.logprobs)
    logprobs: list[JSONObject] | None = None
    # the choice it belongs to (``n`` > 1; its ``finish_reason`` is that choice's: cluster.wire.choices)
    index: int = 0
    # an engine's first chunk: the prompt's logprobs, asked with ``prompt_logprobs`` (vLLM's shape)
    prompt_logprobs: list[JSON] | None = None


# An item of a provider stream's batch (deployments/providers/provider_stream.py): a chunk; a plain text
# delta's text alone; or, read by its bytes (cluster.providers.plain_events), that text's JSON
# string exactly as the provider sent it (printable ASCII, no escapes).
Piece = Chunk | str | bytes


@dataclass
class BackendStats:
    """A cheap load/health snapshot, the same for every kind of backend (vLLM's own counters)."""

    replica: str
    backend: str
    kind: str
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0  # tokens, as vLLM counts them
    prefix_cache_hits: int = 0
    requests_started: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    simulated: bool = False
    healthy: bool = True
    extra: JSONObject = field(default_factory=dict)
