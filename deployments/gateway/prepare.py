"""One request, made ready once: parse and validate the body, tokenize with the target model's own
tokenizer, fit the context window (the model asked for, or a configured bigger-window one; never
a truncated prompt), build the internal request and the candidate backends. Synchronous and
free of I/O, so the gateway runs it inline for small bodies and in a thread for big ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from cluster import tokens
from cluster.config import ClusterConfig, ModelConfig, SurfaceConfig
from cluster.json_types import JSONObject
from cluster.policy import capabilities
from cluster.policy.context import ContextDecision, fit_context
from cluster.routing.block_hash import BlockHash
from cluster.routing.cache_salt import salted_session
from cluster.routing.view import BackendView
from cluster.tokens.images import image_parts, image_tokens
from cluster.wire.errors import ContextLengthExceeded, InvalidRequest, NotFound
from cluster.wire.openai_format import ResponseMeta
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from cluster.wire.requests import build_generate_request, lookup_model, prompt_ids, requested_max_tokens
from deployments import metrics
from deployments.gateway import http_api as h

ApiRequest = ChatCompletionRequest | CompletionRequest  # the bodies of the two routes prepare serves
RouteKind = Literal["chat", "completion"]  # which of the two


@dataclass(frozen=True)
class Prepared:
    """One request as :func:`prepare` made it: read, never written, by everything after it."""

    api: ApiRequest
    req: GenerateRequest
    meta: ResponseMeta
    candidates: list[str]
    hashes: Callable[[str], list[BlockHash]]  # backend -> the prompt's block hashes in its block size
    prep_s: float = 0.0  # from the request's arrival to this (the Server-Timing header's ``prep``)
    max_tokens_capped: int | None = None  # a configured limit shortened max_tokens to this (a header)

    def length_headers(self) -> dict[str, str]:
        """``x-llmc-max-tokens-capped`` when a configured limit shortened the answer (README)."""
        if self.max_tokens_capped is None:
            return {}
        return {"x-llmc-max-tokens-capped": str(self.max_tokens_capped)}

    @property
    def stream(self) -> bool:
        return bool(self.api.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.api.stream_options and self.api.stream_options.include_usage)


# Bigger bodies are validated and tokenized in a worker thread, so the event loop that relays every
# other stream of this gateway keeps running meanwhile (issue 15 item 9).
INLINE_PREPARE_BYTES = 64 * 1024


async def prepare_off_loop(
    cfg: ClusterConfig,
    raw: bytes,
    schema: type[ApiRequest],
    kind: RouteKind,
    request_id: str,
    surface_name: str,
    session_header: str | None,
    views: dict[str, BackendView],
    cache_salt: str | None = None,
) -> Prepared:
    """:func:`prepare`, on the loop for a small body (a thread hop costs more than it saves) and in
    a worker thread for one over ``INLINE_PREPARE_BYTES``."""
    args = (cfg, raw, schema, kind, request_id, surface_name, session_header, views, cache_salt)
    if len(raw) > INLINE_PREPARE_BYTES:
        return await asyncio.to_thread(prepare, *args)
    return prepare(*args)


def _parse(
    cfg: ClusterConfig, raw: bytes, schema: type[ApiRequest], session_header: str | None
) -> tuple[ApiRequest, str | None]:
    """The body validated against its schema, its model known, and the session key checked."""
    api: ApiRequest = h.validate(schema, h.parse_json(raw))
    if cfg.model(api.model) is None:
        raise NotFound(
            f"The model '{api.model}' does not exist or you do not have access to it.", param="model"
        )
    session = session_header or api.user
    if session is not None and not h.SAFE_ID.match(session):
        raise InvalidRequest("x-session-id / user must be 1-128 characters of [A-Za-z0-9._:-].", param="user")
    return api, session


def prepare(
    cfg: ClusterConfig,
    raw: bytes,
    schema: type[ApiRequest],
    kind: RouteKind,
    request_id: str,
    surface_name: str,
    session_header: str | None,
    views: dict[str, BackendView],
    cache_salt: str | None = None,
) -> Prepared:
    """``cache_salt``: the caller's tenant's (:mod:`cluster.routing.cache_salt`): it goes to the
    engine with the request, salts the routing hashes and namespaces the session."""
    api, session = _parse(cfg, raw, schema, session_header)
    session = salted_session(session, cache_salt)
    asked = lookup_model(cfg, api.model)
    counted: dict[str, tuple[list[int], list[JSONObject] | None, str | None]] = {}

    def count(model_name: str) -> int:
        counted[model_name] = _tokenized(cfg, api, model_name)
        return len(counted[model_name][0]) + image_estimate(cfg, model_name, counted[model_name][1])

    surface = cfg.surface(surface_name)
    assert surface is not None  # the gateway resolved it
    fit = _fit(cfg, api, asked, count, kind, surface)
    model = cfg.model(fit.model)
    assert model is not None
    if fit.rerouted_from is not None:
        metrics.CONTEXT_REROUTES.inc(tags={"from_model": asked.name, "to_model": model.name})
    ids, messages, text = counted[model.name]
    req = build_generate_request(
        api,
        model,
        ids,
        messages,
        text,
        request_id=request_id,
        surface=surface.name,
        session_id=session,
        timeout_s=surface.request_timeout_s,
        max_tokens=fit.max_tokens,
        priority=surface.priority,
        max_tokens_asked=requested_max_tokens(api) is not None,
    )
    candidates = supporting_candidates(
        cfg,
        api,
        cfg.candidates(model.name, surface.name),
        model.fim is not None,
        model_gate(model),
        tools=model.tool_calls is not None,
    )
    meta = ResponseMeta(kind=kind, request_id=request_id, model=model.name)
    req.cache_salt = cache_salt
    hashes = _block_hashes(ids, candidates, views, cache_salt)
    return Prepared(api, req, meta, candidates, hashes, max_tokens_capped=fit.capped)


def _tokenized(
    cfg: ClusterConfig, api: ChatCompletionRequest | CompletionRequest, model_name: str
) -> tuple[list[int], list[JSONObject] | None, str | None]:
    """The prompt's ids with ``model_name``'s own tokenizer (its chat, FIM and tool templates)."""
    m = cfg.model(model_name)
    assert m is not None
    return prompt_ids(api, tokens.load(m.tokenizer), m.fim, m.tool_calls)


def count_prompt(cfg: ClusterConfig, raw: bytes) -> int:
    """A chat body's prompt tokens as :func:`prepare` counts them for the context check and
    admission, with the asked model's tokenizer (``POST /v1/messages/count_tokens``): the same
    validation and errors, no capability check, no context fit, no admission."""
    api, _ = _parse(cfg, raw, ChatCompletionRequest, None)
    ids, messages, _ = _tokenized(cfg, api, api.model)
    return len(ids) + image_estimate(cfg, api.model, messages)


def _fit(
    cfg: ClusterConfig,
    api: ChatCompletionRequest | CompletionRequest,
    asked: ModelConfig,
    count: Callable[[str], int],
    kind: str,
    surface: SurfaceConfig,
) -> ContextDecision:
    """The context fit under the surface's output cap; a rejection is counted."""
    param = "messages" if kind == "chat" else "prompt"
    cap = surface.max_output_tokens
    try:
        return fit_context(asked, count, requested_max_tokens(api), cfg.model, param=param, cap=cap)
    except ContextLengthExceeded:
        metrics.CONTEXT_REJECTIONS.inc(tags={"model": asked.name})
        raise


def _block_hashes(
    ids: list[int], candidates: list[str], views: dict[str, BackendView], salt: str | None = None
) -> Callable[[str], list[BlockHash]]:
    """The prompt's block hashes per backend (in its block size, under its cache salt), computed
    here, off the loop for big prompts, once per candidate backend."""
    hashed: dict[str, list[BlockHash]] = {}

    def hashes(backend: str) -> list[BlockHash]:
        view = views.get(backend)
        if view is None or view.policy is None:
            return []
        if backend not in hashed:
            hashed[backend] = view.policy.hash(ids, salt)
        return hashed[backend]

    for name in candidates:
        hashes(name)
    return hashes


def image_estimate(cfg: ClusterConfig, model_name: str, messages: list[JSONObject] | None) -> int:
    """Image parts' tokens for the context check: the most any of the model's providers counts
    (:mod:`cluster.tokens.images`; engines refuse images). The adapter reserves its own count."""
    if not messages or not image_parts(messages):
        return 0
    apis = {b.provider.api for b in cfg.backends if b.model == model_name and b.provider is not None}
    return max((image_tokens(messages, a) for a in apis), default=0)


def model_gate(model: ModelConfig) -> Callable[[list[str]], str | None] | None:
    """A text-only model's check on the fields a request uses (None: the model takes images)."""
    if model.accepts_images:
        return None
    return lambda used: capabilities.text_only_refusal(used, model.name)


def supporting_candidates(
    cfg: ClusterConfig,
    api: ChatCompletionRequest | CompletionRequest,
    candidates: list[str],
    fim: bool = False,
    gate: Callable[[list[str]], str | None] | None = None,
    tools: bool = False,
) -> list[str]:
    """The route's backends that honour every field the request uses (a failover stays among
        them); a 400 naming the field and the backends when none does. ``fim``: the model has a FIM
        template, so self-hosted engines take ``suffix`` too; ``tools``: it has a tool-call format, so
    vLLM takes tools. ``gate``: what the model itself refuses,
        whatever the backend (:func:`model_gate`)."""

    def kind_of(name: str) -> str:
        b = cfg.backend(name)
        return capabilities.backend_kind(b.kind, b.provider.api if b.provider else None)

    used = capabilities.used_fields(api)
    if gate is not None and (why := gate(used)) is not None:
        raise InvalidRequest(why, param="messages", code="unsupported_parameter")
    kept, refusal = capabilities.narrow(used, candidates, kind_of, fim, tools)
    if refusal is not None:
        raise InvalidRequest(refusal.message(), param=refusal.param, code="unsupported_parameter")
    return kept
