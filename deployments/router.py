"""The router deployment: tokenize once → context check → pick a backend and replica → stream back,
measuring TTFT, inter-token latency, tokens and cost. Errors before the first token are raised (the
ingress turns them into HTTP statuses) after trying the next candidate where the error allows;
after the first token a failure ends the stream with a terminal error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import ClusterConfig
from cluster.errors import Action, BackendUnavailable, ClusterError, StreamInterrupted
from cluster.protocol import ChatCompletionRequest, Chunk, CompletionRequest, GenerateRequest
from cluster.requests import (
    build_generate_request,
    check_context,
    lookup_model,
    prompt_ids,
    requested_max_tokens,
)
from cluster.tokens import load_tokenizer
from deployments import metrics
from deployments.request_router import VIEW
from deployments.stats_hub import get_hub

log = logging.getLogger("ray.serve")
HUB_POLL_S = 0.1


def unwrap(exc: BaseException) -> BaseException:
    """Ray wraps a remote exception; the typed cause is what we act on."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@serve.deployment(max_ongoing_requests=4096)
class Router:
    def __init__(self, config: dict[str, Any], backends: dict[str, DeploymentHandle]) -> None:
        self.cfg = ClusterConfig.model_validate(config)
        self.handles = {name: h.options(stream=True) for name, h in backends.items()}
        self._hub = get_hub(self.cfg.name)
        self._poller = asyncio.get_event_loop().create_task(self._poll_hub())
        for m in self.cfg.models:  # load tokenizers now, not on the first request
            load_tokenizer(m.tokenizer)

    async def _poll_hub(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                VIEW.stats = await self._hub.snapshot.remote()
                metrics.record_backend_stats(VIEW.stats)
            await asyncio.sleep(HUB_POLL_S)

    async def replica_stats(self) -> dict[str, Any]:
        """What each backend replica last reported (tests and operators)."""
        return await self._hub.snapshot.remote()

    # ------------------------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Chunk]:
        t0 = time.perf_counter()
        api = (
            ChatCompletionRequest.model_validate(body)
            if ctx["kind"] == "chat"
            else CompletionRequest.model_validate(body)
        )
        req = await asyncio.to_thread(self._prepare, api, ctx)
        surface = req.surface
        first_at: float | None = None
        last_at = t0
        try:
            async for chunk in self._attempts(req):
                now = time.perf_counter()
                if chunk.token_ids or chunk.text:
                    if first_at is None:
                        first_at = now
                        metrics.TTFT.observe(
                            now - t0, tags={"surface": surface, "backend": chunk.backend or ""}
                        )
                    else:
                        metrics.ITL.observe(now - last_at, tags={"surface": surface})
                    last_at = now
                if chunk.usage is not None:
                    metrics.record_usage(surface, chunk.backend or "", chunk.usage)
                    metrics.LATENCY.observe(now - t0, tags={"surface": surface, "outcome": "completed"})
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            metrics.ENDINGS.inc(tags={"surface": surface, "outcome": "cancelled"})
            raise
        except Exception:
            metrics.ENDINGS.inc(tags={"surface": surface, "outcome": "errored"})
            raise
        else:
            metrics.ENDINGS.inc(tags={"surface": surface, "outcome": "completed"})

    def _prepare(
        self, api: ChatCompletionRequest | CompletionRequest, ctx: dict[str, Any]
    ) -> GenerateRequest:
        model = lookup_model(self.cfg, api.model)
        tok = load_tokenizer(model.tokenizer)
        ids, messages, text = prompt_ids(api, tok)
        max_tokens = check_context(model, len(ids), requested_max_tokens(api))
        surface = self.cfg.surface(ctx["surface"])
        assert surface is not None  # the ingress resolved it
        return build_generate_request(
            api,
            model,
            ids,
            messages,
            text,
            request_id=ctx["request_id"],
            surface=surface.name,
            session_id=ctx.get("session_id"),
            timeout_s=surface.request_timeout_s,
            max_tokens=max_tokens,
        )

    async def _attempts(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Try candidates in order until one produces its first chunk; never switch after that."""
        candidates = self.cfg.candidates(req.model, req.surface)
        last_error: ClusterError | None = None
        for attempt, name in enumerate(candidates):
            req.attempt = attempt
            gen = self.handles[name].generate.remote(req)
            started = False
            try:
                async for chunk in gen:
                    started = True
                    yield chunk
                return
            except Exception as raw:
                exc = unwrap(raw)
                err = (
                    exc
                    if isinstance(exc, ClusterError)
                    else BackendUnavailable(f"{name}: {exc}", backend=name)
                )
                if started:
                    raise (
                        err if isinstance(err, StreamInterrupted) else StreamInterrupted(err.message)
                    ) from exc
                if err.action != Action.RETRY_ELSEWHERE:
                    raise err from exc
                metrics.FAILOVERS.inc(tags={"backend": name, "code": err.code or ""})
                log.warning(
                    "request %s: backend %s failed before the first token: %s", req.request_id, name, err
                )
                last_error = err
            finally:
                gen.cancel()
        raise last_error or BackendUnavailable(f"no backend serves model '{req.model}'")
