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
from dataclasses import fields
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.admission import AdmissionController, AsyncAdmission, Outcome
from cluster.affinity import AffinityParams, AffinityRouter
from cluster.config import BackendConfig, ClusterConfig
from cluster.context import fit_context
from cluster.errors import ClusterError, ContextLengthExceeded
from cluster.protocol import ChatCompletionRequest, Chunk, CompletionRequest, GenerateRequest
from cluster.providers.budget import Prices, cost_usd
from cluster.requests import build_generate_request, lookup_model, prompt_ids, requested_max_tokens
from cluster.tokens import load_tokenizer
from deployments import metrics, routing_state
from deployments.attempts import AttemptRunner
from deployments.stats_hub import get_hub

log = logging.getLogger("ray.serve")
HUB_POLL_S = 0.1


def block_size(b: BackendConfig) -> int:
    """The engine's KV block size: routing hashes prompts in the same blocks the engine caches."""
    if b.engine.block_size:
        return b.engine.block_size
    if b.kind == "sim":
        from cluster.profiles import get_profile
        from cluster.sim_backend import DEFAULT_PROFILE

        return get_profile(b.sim_profile or DEFAULT_PROFILE).engine.block_size
    return 16  # vLLM's GPU default


def unwrap(exc: BaseException) -> BaseException:
    """Ray wraps a remote exception; the typed cause is what we act on."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@serve.deployment(max_ongoing_requests=4096)
class Router:
    def __init__(self, config: dict[str, Any], backends: dict[str, DeploymentHandle]) -> None:
        self.cfg = ClusterConfig.model_validate(config)
        self.handles = {name: h.options(stream=True) for name, h in backends.items()}
        self.admission = AsyncAdmission(AdmissionController.from_config(self.cfg))
        self.attempts = AttemptRunner(self.cfg, self.handles)
        self.prices = {
            b.name: Prices.from_config(b.provider) for b in self.cfg.backends if b.provider is not None
        }
        for b in self.cfg.backends:
            routing_state.VIEW.backends[b.name] = b
            if b.kind != "provider":  # self-hosted: cache-aware replica choice
                routing_state.VIEW.policies[b.name] = AffinityRouter(block_size(b), b.model, AffinityParams())
        self._hub = get_hub(self.cfg.name)
        self._poller = asyncio.get_event_loop().create_task(self._poll_hub())
        for m in self.cfg.models:  # load tokenizers now, not on the first request
            load_tokenizer(m.tokenizer)

    async def _poll_hub(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                routing_state.VIEW.stats = await self._hub.snapshot.remote()
                metrics.record_backend_stats(routing_state.VIEW.stats)
                metrics.record_breakers(self.attempts.board.metrics(time.monotonic()))
            await asyncio.sleep(HUB_POLL_S)

    async def replica_stats(self) -> dict[str, Any]:
        """What each backend replica last reported (tests and operators)."""
        return await self._hub.snapshot.remote()

    # ------------------------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Chunk]:
        t0 = time.perf_counter()
        schema = ChatCompletionRequest if ctx["kind"] == "chat" else CompletionRequest
        api = schema.model_validate(body)
        req, candidates = await asyncio.to_thread(self._prepare, api, ctx)
        surface = req.surface
        try:
            ticket = await self.admission.acquire(surface, candidates)
        except ClusterError as err:
            metrics.REJECTIONS.inc(tags={"surface": surface, "code": err.code or ""})
            routing_state.VIEW.forget_request(req.request_id)
            raise
        metrics.ADMISSIONS.inc(tags={"surface": surface})
        metrics.QUEUE_WAIT.observe(ticket.waited_s, tags={"surface": surface})
        if ticket.backend in candidates:  # admission picked the first candidate with room
            candidates = candidates[candidates.index(ticket.backend) :]
        outcome = Outcome.CANCELLED
        first_at: float | None = None
        last_at = t0
        try:
            async for chunk in self.attempts.run(req, candidates):
                if first_at is None:
                    chunk.model = req.model
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
                    backend = chunk.backend or ""
                    metrics.record_usage(surface, backend, chunk.usage)
                    if backend in self.prices and (cost := cost_usd(chunk.usage, self.prices[backend])) > 0:
                        metrics.COST.inc(cost, tags={"surface": surface, "backend": backend})
                    metrics.LATENCY.observe(now - t0, tags={"surface": surface, "outcome": "completed"})
                yield chunk
            outcome = Outcome.COMPLETED
        except (asyncio.CancelledError, GeneratorExit):
            outcome = Outcome.CANCELLED
            raise
        except Exception:
            outcome = Outcome.ERRORED
            raise
        finally:
            self.admission.release(ticket, outcome)
            metrics.ENDINGS.inc(tags={"surface": surface, "outcome": outcome.value})

    async def admission_counters(self) -> dict[str, Any]:
        """Exactly-once accounting: admitted == completed + errored + cancelled + in flight."""
        c = self.admission.controller.counters()
        return {"balanced": c.balanced(), **{f.name: getattr(c, f.name) for f in fields(c)}}

    async def policy_snapshot(self) -> dict[str, Any]:
        """Breaker states, hedges sent/won/cancelled and the extra upstream load ratio."""
        return self.attempts.snapshot()

    async def routing_decisions(self) -> dict[str, int]:
        return {f"{b}:{r}": n for (b, r), n in routing_state.VIEW.decision_counts.items()}

    def _prepare(
        self, api: ChatCompletionRequest | CompletionRequest, ctx: dict[str, Any]
    ) -> tuple[GenerateRequest, list[str]]:
        """Tokenize with the target model's own tokenizer and fit the context window: the model
        asked for, or a configured bigger-window one; never a truncated prompt."""
        asked = lookup_model(self.cfg, api.model)
        counted: dict[str, tuple[list[int], list[dict[str, Any]] | None, str | None]] = {}

        def count(model_name: str) -> int:
            m = self.cfg.model(model_name)
            assert m is not None
            counted[model_name] = prompt_ids(api, load_tokenizer(m.tokenizer))
            return len(counted[model_name][0])

        param = "messages" if ctx["kind"] == "chat" else "prompt"
        try:
            fit = fit_context(asked, count, requested_max_tokens(api), self.cfg.model, param=param)
        except ContextLengthExceeded:
            metrics.CONTEXT_REJECTIONS.inc(tags={"model": asked.name})
            raise
        model = self.cfg.model(fit.model)
        assert model is not None
        if fit.rerouted_from is not None:
            metrics.CONTEXT_REROUTES.inc(tags={"from_model": asked.name, "to_model": model.name})
        ids, messages, text = counted[model.name]
        surface = self.cfg.surface(ctx["surface"])
        assert surface is not None  # the ingress resolved it
        req = build_generate_request(
            api,
            model,
            ids,
            messages,
            text,
            request_id=ctx["request_id"],
            surface=surface.name,
            session_id=ctx.get("session_id"),
            timeout_s=surface.request_timeout_s,
            max_tokens=fit.max_tokens,
        )
        candidates = self.cfg.candidates(model.name, surface.name)
        for name in candidates:  # block hashes for the cache-aware choice, once per block size
            policy = routing_state.VIEW.policies.get(name)
            if policy is not None:
                routing_state.VIEW.hashes[(req.request_id, name)] = policy.hash(ids)
        return req, candidates
