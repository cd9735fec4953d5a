"""Context-window policy: does prompt + completion fit the model, or a bigger one it overflows to?

Tokens are counted by the caller with each candidate model's own tokenizer (``count_tokens(name)``),
since a bigger-window model may tokenize differently. We never truncate: a request that fits
nowhere is a 400 ``context_length_exceeded``, phrased as OpenAI phrases it so clients that parse
the message (several do, to retry with less) keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.config import ModelConfig
from cluster.wire.errors import ContextLengthExceeded, InvalidRequest


@dataclass(frozen=True)
class ContextDecision:
    model: str  # the model to serve the request
    max_tokens: int  # completion tokens to ask the engine for
    prompt_tokens: int  # counted with that model's tokenizer
    rerouted_from: str | None = None  # the requested model, when the request overflowed elsewhere


@dataclass(frozen=True)
class _Tried:
    model: ModelConfig
    prompt_tokens: int


def fit_context(
    model: ModelConfig,
    count_tokens: Callable[[str], int],
    max_tokens: int | None,
    lookup: Callable[[str], ModelConfig | None],
    *,
    param: str = "messages",
) -> ContextDecision:
    """Decide where a request goes, following ``overflow_to`` until a window fits.

    A model fits when ``prompt + max_tokens <= context_window``; with no ``max_tokens`` it fits when
    at least one completion token is left, and gets ``min(default_max_tokens, window - prompt)``.
    ``lookup`` resolves overflow names (``ClusterConfig.model``); a cycle or an unknown name ends
    the chain. ``param`` names the offending request field in the error (``prompt`` for completions).
    """
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    tried: list[_Tried] = []
    seen: set[str] = set()
    current: ModelConfig | None = model
    while current is not None and current.name not in seen:
        seen.add(current.name)
        prompt = count_tokens(current.name)
        room = current.context_window - prompt
        if max_tokens is None and room >= 1:
            budget = min(current.default_max_tokens, room)
            return _decision(current, budget, prompt, model)
        if max_tokens is not None and max_tokens <= room:
            return _decision(current, max_tokens, prompt, model)
        tried.append(_Tried(current, prompt))
        current = lookup(current.overflow_to) if current.overflow_to is not None else None
    raise ContextLengthExceeded(_message(tried, max_tokens, param), param=param)


def _decision(m: ModelConfig, max_tokens: int, prompt: int, requested: ModelConfig) -> ContextDecision:
    rerouted = requested.name if m.name != requested.name else None
    return ContextDecision(m.name, max_tokens, prompt, rerouted)


def _message(tried: list[_Tried], max_tokens: int | None, param: str) -> str:
    where = "the messages" if param == "messages" else "the prompt"
    first, rest = tried[0], tried[1:]
    window, prompt = first.model.context_window, first.prompt_tokens
    if max_tokens is None:
        text = (
            f"This model's maximum context length is {window} tokens. However, your {param} resulted in "
            f"{prompt} tokens, which leaves no room for the completion. Please reduce the length of {where}."
        )
    else:
        text = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in {where}, {max_tokens} in the completion). "
            f"Please reduce the length of {where} or completion."
        )
    if rest:
        others = ", ".join(
            f"'{t.model.name}' (maximum context length {t.model.context_window} tokens, "
            f"{t.prompt_tokens} in {where})"
            for t in rest
        )
        text += f" The models it overflows to do not fit it either: {others}."
    return text
