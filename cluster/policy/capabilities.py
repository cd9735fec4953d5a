"""Which request fields each kind of backend honours, and the candidates a request may use.

A request field the chosen backend cannot honour is refused with a 400 that names the field and
the backend that cannot do it; it is never dropped in silence. A route's candidates are narrowed to
the backends that honour everything the request uses, so a failover never lands on one that would
ignore part of it. Pure: no I/O, no Ray.

Kinds: ``vllm`` and ``sim`` (self-hosted engines; the simulator models vLLM, so it takes vLLM's
sampling fields, but it produces no tools or JSON; vLLM serves tools for models with a tool-call
format), ``openai`` (an OpenAI-compatible provider: every
OpenAI field is passed through as sent) and ``anthropic`` (the Messages API: what has an exact
translation).

A field counts as used only when its value asks for something (``logprobs: false``, ``n: 1``,
``response_format: {"type": "text"}``, ``tools: []`` and ``temperature`` within 0..1 ask nothing a
backend could ignore).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from cluster.backend_kind import BackendKind
from cluster.json_types import JSON
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest

Kind = Literal["vllm", "sim", "openai", "anthropic"]
KINDS: tuple[Kind, ...] = ("vllm", "sim", "openai", "anthropic")
_ALL = frozenset(KINDS)
_ENGINES = frozenset({"vllm", "sim"})
_OPENAI = frozenset({"openai"})
_TOOLS = frozenset({"openai", "anthropic"})
IMAGES = "messages[].content[].image_url"

# field -> the kinds that honour it. Fields every kind honours (model, messages, max_tokens, stop,
# stream, stream_options, top_p, user, metadata) are not listed.
SUPPORT: dict[str, frozenset[str]] = {
    # sampling
    "temperature": _ENGINES | _OPENAI,  # only a value above 1 (Anthropic's range is 0..1)
    "seed": _ENGINES | _OPENAI,
    "presence_penalty": _ENGINES | _OPENAI,
    "frequency_penalty": _ENGINES | _OPENAI,
    "ignore_eos": _ENGINES,
    "logit_bias": _OPENAI,
    "logprobs": _OPENAI | {"vllm"},
    "top_logprobs": _OPENAI | {"vllm"},
    "n": _OPENAI | {"vllm"},  # only above 1: choices
    "prompt_logprobs": frozenset({"vllm"}),  # vLLM's extension (OpenAI's API has none)
    # tools
    "tools": _TOOLS,
    "tool_choice": _TOOLS,
    "parallel_tool_calls": _TOOLS,
    "tools[].function.strict": _OPENAI,
    "messages[].tool_calls": _TOOLS,
    "messages[].role=tool": _TOOLS,
    # structured output
    "response_format": _OPENAI | {"vllm"},
    # Anthropic's extended thinking: the config, and the blocks (with signatures) sent back
    "thinking": frozenset({"anthropic"}),
    "messages[].thinking_blocks": frozenset({"anthropic"}),
    # content
    "messages[].name": _OPENAI,
    # OpenAI passes it through, Anthropic as image blocks; a text-only model (ModelConfig.accepts_images
    # false) refuses it on every backend (text_only_refusal)
    IMAGES: _TOOLS,
    "messages[].content[].cache_control": frozenset({"anthropic"}),
    "messages[].content[].input_audio": _OPENAI,
    "messages[].content[].file": _OPENAI,
    "messages[].audio": _OPENAI,
    "messages[].function_call": _OPENAI,
    # completions
    "suffix": _OPENAI,
    "echo": _OPENAI,
    "best_of": _OPENAI,
    # OpenAI platform fields: only OpenAI itself knows what to do with them
    **{
        f: _OPENAI
        for f in (
            "audio",
            "function_call",
            "functions",
            "modalities",
            "prediction",
            "prompt_cache_key",
            "prompt_cache_retention",
            "reasoning_effort",
            "safety_identifier",
            "service_tier",
            "store",
            "verbosity",
            "web_search_options",
        )
    },
}


# Honoured only on models that say how: a FIM template (ModelConfig.fim) lets engines take suffix;
# a tool-call format (ModelConfig.tool_calls) lets vLLM take tools (the simulator writes no calls).
WITH_FIM: dict[str, frozenset[str]] = {"suffix": _ENGINES}
_VLLM = frozenset({"vllm"})
WITH_TOOLS: dict[str, frozenset[str]] = {
    f: _VLLM
    for f in ("tools", "tool_choice", "parallel_tool_calls", "messages[].tool_calls", "messages[].role=tool")
}


_ENGINE_KINDS: dict[BackendKind, Kind] = {BackendKind.VLLM: "vllm", BackendKind.SIM: "sim"}


def backend_kind(kind: str, api: str | None) -> Kind:
    """A backend config's kind (a :class:`BackendKind` or its name) as this table knows it (a
    provider splits by its API)."""
    if kind not in BackendKind.__members__.values():
        raise ValueError(f"unknown backend kind {kind!r}")
    if not BackendKind(kind).caps.engine_replicas:
        return "anthropic" if api == "anthropic" else "openai"
    return _ENGINE_KINDS[BackendKind(kind)]


def _asks(name: str, value: JSON) -> bool:
    # ``{}`` asks for something in some fields (``web_search_options: {}`` turns search on).
    if name in ("logprobs", "prompt_logprobs") and type(value) is int:  # 0: the tokens' own
        return True
    return value not in (None, False, [], "") and not (value == {} and name == "logit_bias")


def _top_level(api: ChatCompletionRequest | CompletionRequest) -> list[str]:
    used = []
    for name in api.model_fields_set:
        if name not in SUPPORT or not _asks(name, getattr(api, name)):
            continue
        if name == "temperature" and (api.temperature or 0) <= 1:
            continue
        if name in ("best_of", "n") and getattr(api, name) == 1:
            continue
        if isinstance(api, ChatCompletionRequest) and _chat_default(name, api):
            continue
        used.append(name)
    return used


def _chat_default(name: str, api: ChatCompletionRequest) -> bool:
    """A chat-only field set to what asking nothing means: text out, plain text, no thinking."""
    if name == "modalities":
        return bool(api.modalities == ["text"])
    if name == "response_format":
        return api.response_format is not None and api.response_format.type == "text"
    if name == "thinking":
        return api.thinking is not None and api.thinking.get("type") == "disabled"
    return False


def _in_messages(api: ChatCompletionRequest) -> list[str]:
    used: set[str] = set()
    if any(t.function.strict for t in api.tools or []):
        used.add("tools[].function.strict")
    for m in api.messages:
        if m.tool_calls:
            used.add("messages[].tool_calls")
        if m.role == "tool":
            used.add("messages[].role=tool")
        if m.thinking_blocks:
            used.add("messages[].thinking_blocks")
        for name in ("name", "audio", "function_call"):
            if getattr(m, name) is not None:
                used.add(f"messages[].{name}")
        if isinstance(m.content, list):
            used.update(
                f"messages[].content[].{p.type}" for p in m.content if p.type not in ("text", "refusal")
            )
            if any(p.cache_control is not None for p in m.content):
                used.add("messages[].content[].cache_control")
    return sorted(used)


def used_fields(api: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The fields of a request that some backend kind could not honour, in a stable order."""
    used = sorted(_top_level(api))
    if isinstance(api, ChatCompletionRequest):
        used += _in_messages(api)
    return used


def text_only_refusal(used: Iterable[str], model: str) -> str | None:
    """Why a text-only model (``accepts_images: false``) cannot take the request, if it cannot:
    images, whatever backend would serve it."""
    if IMAGES not in used:
        return None
    return (
        f"Model '{model}' is text-only (accepts_images: false): it cannot honour '{IMAGES}'. "
        "Remove the image parts, or ask a model that accepts images."
    )


def unsupported(used: Iterable[str], kind: str, fim: bool = False, tools: bool = False) -> list[str]:
    """``fim`` / ``tools``: the model has a FIM template / a tool-call format."""
    return [
        f
        for f in used
        if kind not in SUPPORT[f]
        and not (fim and kind in WITH_FIM.get(f, ()))
        and not (tools and kind in WITH_TOOLS.get(f, ()))
    ]


@dataclass(frozen=True)
class Refusal:
    """Why no candidate can serve the request: for each candidate, the first field it lacks."""

    missing: list[tuple[str, str, str]]  # (backend name, kind, field)

    @property
    def field(self) -> str:
        return self.missing[0][2]

    @property
    def param(self) -> str:
        """The top-level request field, as OpenAI's error ``param`` names it."""
        return self.field.split("[", 1)[0].split("=", 1)[0].split(".", 1)[0]

    def message(self) -> str:
        parts = [f"backend '{name}' (kind {kind}) cannot honour {_what(f)}" for name, kind, f in self.missing]
        return "This request cannot be served as asked: " + "; ".join(parts) + "."


def _what(field: str) -> str:
    return "'temperature' above 1" if field == "temperature" else f"'{field}'"


def narrow(
    used: list[str],
    candidates: list[str],
    kind_of: Callable[[str], str],
    fim: bool = False,
    tools: bool = False,
) -> tuple[list[str], Refusal | None]:
    """The candidates that honour every used field, in order (a failover stays among them); when
    none does, the refusal says what each candidate lacks. ``fim``: the model has a FIM template;
    ``tools``: a tool-call format."""
    lacks = {c: unsupported(used, kind_of(c), fim, tools) for c in candidates}
    kept = [c for c in candidates if not lacks[c]]
    if kept or not candidates:
        return kept, None
    return [], Refusal([(c, kind_of(c), lacks[c][0]) for c in candidates])
