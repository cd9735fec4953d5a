"""Mid-stream migration, as pure rules: when a self-hosted stream that already sent tokens to the
client breaks (its replica died, drained or went silent), may the gateway continue it on another
replica, and what does the continuation look like.

The continuation is the same request with the tokens already sent appended to its prompt, the
remaining ``max_tokens`` and the same sampling parameters and seed: an engine that samples
deterministically (greedy vLLM, the simulator's seeded sampler) produces exactly the tokens the
uninterrupted run would have; any engine produces a valid continuation of what the client has.
Never for a provider backend (its stream cannot be resumed from token ids), never across models,
never under structured decoding or a tool-call parser (their state is not in the token ids) nor
with ``logprobs`` (a completion's text offsets would restart) or ``n`` > 1 (its choices), at
most ``max_per_request`` times per request and within a budget shared by all requests
(``ratio`` of the requests in a sliding window, plus ``min_per_s``), like the retry budget. When
migration is refused the stream ends as before: one clean terminal error event.

The gateway (``deployments/gateway/migration.py``) applies these; tests check them alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from cluster.backend_kind import BackendKind
from cluster.base import Strict
from cluster.policy.failover import RetryBudget
from cluster.wire.errors import UpstreamTimeout
from cluster.wire.protocol import GenerateRequest, Usage

Reason = Literal["death", "drain", "stall", "error"]
REASONS: tuple[Reason, ...] = ("death", "drain", "stall", "error")
DRAINING_CODE = "engine_draining"  # an engine replica that is shutting down ends its streams so


class MigrationConfig(Strict):
    enabled: bool = Field(
        True, description="Continue a self-hosted stream on another replica when it breaks."
    )
    max_per_request: int = Field(2, ge=0, description="Migrations one request may make.")
    ratio: float = Field(0.1, ge=0, description="Migrations allowed per request over the window.")
    min_per_s: float = Field(1.0, ge=0, description="Migrations per second allowed regardless of traffic.")
    window_s: float = Field(10.0, gt=0, description="Window over which requests and migrations are counted.")
    window_buckets: int = Field(10, gt=0, description="Slots of the window.")
    reasons: list[Reason] = Field(
        default_factory=lambda: list(REASONS),
        description="Breaks that migrate: death (connection lost), drain, stall (idle timeout), error.",
    )
    min_time_left_s: float = Field(
        0.5, ge=0, description="No migration with less time than this to the deadline."
    )


def classify(fault: str | None, err: BaseException) -> Reason:
    """Why a stream broke: what its engine stream saw (``fault``: death, drain, error), else a
    watchdog's timeout (a stall, or the deadline: the policy tells them apart by the time left)."""
    if fault in REASONS:
        return fault
    if isinstance(err.__cause__, UpstreamTimeout) or isinstance(err, UpstreamTimeout):
        return "stall"
    return "error"


@dataclass(frozen=True)
class Break:
    """What the gateway knows when a stream broke after its first token."""

    reason: Reason
    backend_kind: str  # vllm, sim or provider
    migrations: int  # made by this request so far
    tokens_known: bool  # the engine told us the ids of the tokens sent (the stream carried them)
    time_left_s: float | None  # to the request's deadline (None: no deadline)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    why: str  # "migrate", or the refusal: disabled, provider, reason, max_per_request, ...


class MigrationPolicy:
    """One per gateway process: the config and the budget shared by its requests."""

    def __init__(self, config: MigrationConfig | None = None) -> None:
        self.config = config or MigrationConfig()
        self._budget = RetryBudget(self.config)  # the retries' ratio budget, spent on migrations

    def on_request(self, now: float) -> None:
        self._budget.deposit(now)

    def available(self, now: float) -> float:
        return self._budget.available(now)

    def decide(self, req: GenerateRequest, brk: Break, now: float) -> Decision:
        """May this broken stream continue elsewhere? Allowing spends one from the budget."""
        why = self._refusal(req, brk)
        if why is None and not self._budget.try_spend(now):
            why = "budget"
        if why is not None:
            return Decision(False, why)
        return Decision(True, "migrate")

    def _refusal(self, req: GenerateRequest, brk: Break) -> str | None:
        c, s = self.config, req.sampling
        if not c.enabled:
            return "disabled"
        if not BackendKind(brk.backend_kind).caps.migratable:
            return "provider"
        if brk.reason not in c.reasons:
            return "reason"
        if brk.migrations >= c.max_per_request:
            return "max_per_request"
        if not brk.tokens_known:
            return "tokens_unknown"
        if brk.time_left_s is not None and brk.time_left_s < c.min_time_left_s:
            return "deadline"
        # An engine holds text back near a stop string, and penalties count output tokens only:
        # at the seam the ids sent and the text sent could disagree, or the continuation diverge.
        if s.stop:
            return "stop_strings"
        if s.presence_penalty or s.frequency_penalty:
            return "penalties"
        # Structured decoding (response_format, a forced tool call) would restart its grammar on
        # the new replica at the continuation's first token, not where the text stands; a tool-call
        # parser there would not know the calls already sent. The stream ends as before.
        if s.structured:
            return "structured"
        # logprobs: the continuation's completion offsets would restart at its own first token
        if s.logprobs is not None:
            return "logprobs"
        # n > 1: the choices interleave in one stream; each would need its own continuation
        if s.n > 1:
            return "n"
        if req.tool_parse:
            return "tools"
        return None


def continuation(req: GenerateRequest, emitted: list[int], attempt: int) -> GenerateRequest:
    """The request that continues ``req`` after the tokens ``emitted`` (all those sent, across
    earlier migrations): prompt + emitted, the remaining max_tokens (at least 1: the caller ends a
    stream that used them all itself), the same sampling parameters and seed."""
    s = req.sampling
    left = max(1, s.max_tokens - len(emitted))
    return dataclasses.replace(
        req,
        prompt_token_ids=[*req.prompt_token_ids, *emitted],
        sampling=dataclasses.replace(s, max_tokens=left),
        attempt=attempt,
    )


def client_usage(prompt_tokens: int, emitted: int, last: Usage | None) -> Usage:
    """The client's usage for a migrated answer: its own prompt once, every token it was sent once
    (``emitted`` before the last attempt, plus what the last one produced). Cached tokens: the
    last attempt's hits, within the client's prompt (the first attempt's count died with it)."""
    last = last or Usage()
    return Usage(prompt_tokens, emitted + last.completion_tokens, min(last.cached_tokens, prompt_tokens))
