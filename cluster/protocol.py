"""Wire schemas (OpenAI-compatible requests) and the internal request/chunk types every backend speaks.

The wire models accept unknown fields (clients send many we do not use) but type-check the ones
we read. The internal types are plain dataclasses: cheap to build, pickled across Ray processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

# --------------------------------------------------------------------------------------------
# Wire (OpenAI) schemas
# --------------------------------------------------------------------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Wire):
    include_usage: StrictBool = False


class ContentPart(_Wire):
    type: str
    text: str | None = None


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class _SamplingFields(_Wire):
    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    ignore_eos: StrictBool = False  # vLLM extension: benchmarks need exact output lengths

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be at least 1")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_mct(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("max_completion_tokens must be at least 1")
        return v


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    echo: StrictBool = False


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


@dataclass
class GenerateRequest:
    """What the router hands a backend: tokenized once, with the original messages kept for providers."""

    request_id: str
    model: str
    kind: Literal["chat", "completion"]
    prompt_token_ids: list[int]
    sampling: Sampling
    messages: list[dict[str, Any]] | None = None  # chat requests, for provider adapters
    prompt_text: str | None = None  # completion requests (or the rendered chat prompt)
    surface: str = "chat"
    priority: int = 0  # the surface's: the engine schedules lower numbers first (vLLM's priority policy)
    session_id: str | None = None
    deadline: float | None = None  # epoch seconds
    attempt: int = 0  # 0 for the first try, 1.. for failovers and hedges
    exclude_replicas: list[str] = field(default_factory=list)  # a hedge or retry avoids these

    @property
    def route_key(self) -> str:
        """One attempt of one request (a request's attempts may go to different replicas)."""
        return f"{self.request_id}/{self.attempt}"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

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
    extra: dict[str, Any] = field(default_factory=dict)
