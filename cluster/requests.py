"""Turn a validated OpenAI request into the internal :class:`GenerateRequest`: tokenize once and
fill in sampling defaults (the context window is :mod:`cluster.context`'s). Pure (the tokenizer
is passed in), so the gateway can call it off its event loop.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.config import ClusterConfig, ModelConfig
from cluster.errors import InvalidRequest, NotFound
from cluster.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, Sampling
from cluster.tokens import Tokenizer

ApiRequest = ChatCompletionRequest | CompletionRequest


def lookup_model(cfg: ClusterConfig, name: str) -> ModelConfig:
    model = cfg.model(name)
    if model is None:
        raise NotFound(f"The model '{name}' does not exist or you do not have access to it.", param="model")
    return model


def prompt_ids(req: ApiRequest, tok: Tokenizer) -> tuple[list[int], list[dict[str, Any]] | None, str | None]:
    """The prompt's token ids, plus what providers need: the messages (chat) or the text."""
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        return tok.chat_ids(messages), messages, None
    if isinstance(req.prompt, list):
        if not tok.exact:
            raise InvalidRequest("token-id prompts need a model with an exact tokenizer", param="prompt")
        return list(req.prompt), None, None
    return tok.encode(req.prompt), None, req.prompt


def build_generate_request(
    req: ApiRequest,
    model: ModelConfig,
    ids: list[int],
    messages: list[dict[str, Any]] | None,
    text: str | None,
    *,
    request_id: str,
    surface: str,
    session_id: str | None,
    timeout_s: float,
    max_tokens: int,
    priority: int = 0,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model=model.name,
        kind="chat" if isinstance(req, ChatCompletionRequest) else "completion",
        prompt_token_ids=ids,
        sampling=Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=req.stop_list(),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
        ),
        messages=messages,
        prompt_text=text,
        surface=surface,
        priority=priority,
        session_id=session_id,
        deadline=time.time() + timeout_s,
    )


def requested_max_tokens(req: ApiRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens
