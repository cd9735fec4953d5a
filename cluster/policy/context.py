"""Context-window policy: does prompt + completion fit the model, or a bigger one it overflows to?

Tokens are counted by the caller with each candidate model's own tokenizer (``count_tokens(name)``),
since a bigger-window model may tokenize differently. We never truncate: a request that fits
nowhere is a 400 ``context_length_exceeded``, phrased as OpenAI phrases it so clients that parse
the message (several do, to retry with less) keep working.

A request without ``max_tokens`` gets what OpenAI and vLLM promise: the rest of the window. Two
configured limits may lower it, and an answer they shorten says so (``ContextDecision.capped``, the
``x-llmc-max-tokens-capped`` header): the model's ``default_max_tokens`` (only when the client asked
nothing: a model whose own output limit is below its window, or one that never stops on its own) and
the surface's ``max_output_tokens`` (a cap on every request, an explicit larger ask lowered too).
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
    # max_tokens when a configured limit lowered it below the client's ask (or, asked nothing, below
    # the rest of the window): the x-llmc-max-tokens-capped header. None: nothing was shortened.
    capped: int | None = None


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
    cap: int | None = None,
) -> ContextDecision:
    """Decide where a request goes, following ``overflow_to`` until a window fits.

    A model fits when ``prompt + max_tokens <= context_window``; with no ``max_tokens`` it fits when
    at least one completion token is left, and gets the rest of the window, lowered to the model's
    ``default_max_tokens`` when set. ``cap`` (the surface's ``max_output_tokens``) lowers either,
    an explicit ``max_tokens`` too, before the window check. ``lookup`` resolves overflow names
    (``ClusterConfig.model``); a cycle or an unknown name ends the chain. ``param`` names the
    offending request field in the error (``prompt`` for completions).
    """
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    want = max_tokens if cap is None or max_tokens is None else min(max_tokens, cap)
    tried: list[_Tried] = []
    seen: set[str] = set()
    current: ModelConfig | None = model
    while current is not None and current.name not in seen:
        seen.add(current.name)
        prompt = count_tokens(current.name)
        room = current.context_window - prompt
        if want is None and room >= 1:
            limits = [n for n in (current.default_max_tokens, cap) if n is not None]
            budget = min([room, *limits])
            return _decision(current, budget, prompt, model, budget if budget < room else None)
        if want is not None and want <= room:
            return _decision(current, want, prompt, model, want if want != max_tokens else None)
        tried.append(_Tried(current, prompt))
        current = lookup(current.overflow_to) if current.overflow_to is not None else None
    raise ContextLengthExceeded(_message(tried, want, param), param=param)


def _decision(
    m: ModelConfig, max_tokens: int, prompt: int, requested: ModelConfig, capped: int | None
) -> ContextDecision:
    rerouted = requested.name if m.name != requested.name else None
    return ContextDecision(m.name, max_tokens, prompt, rerouted, capped)


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


def reserved_output(max_tokens: int, input_tokens: int, tpm: int | None, asked: bool, n: int = 1) -> int:
    """The completion tokens a token budget (a tenant's or a provider's ``tpm``) reserves for a
    request: its ``max_tokens`` for each of its ``n`` choices, the most it may use, as providers
    count it too. One the client did not ask for (the rest of the window) may exceed a whole
    minute's budget, which would refuse it for good for a size nobody asked: then it is trimmed to
    what the budget holds beside the prompt. Either way the request settles with its usage."""
    if asked or tpm is None:
        return max_tokens * n
    return max(1, min(max_tokens * n, tpm - input_tokens))
