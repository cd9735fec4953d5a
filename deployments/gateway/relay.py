"""The token path of one request, in the gateway: the first-token race, then the winner's stream
to the client, then the accounting.

Every attempt's stream is the one seam of :mod:`cluster.wire.stream`: the client's SSE bytes (an
engine replica's passed through as read; a provider adapter's typed chunks framed on the way by
:mod:`cluster.wire.framing`), and one :class:`cluster.wire.stream.Ending` when it is over. Per
chunk: one read, one ``send``, a clock stamp. No task, no timer (one watchdog per
stream, in :func:`cluster.policy.race.follow`), no metrics call: those come once, at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.observability.server_timing import server_timing
from cluster.policy.admission_types import Outcome
from cluster.policy.attempts import backend_of_slot
from cluster.policy.race import Attempt, RaceResult, first_token, follow
from cluster.policy.slo_guard import SloGuard
from cluster.policy.tenants import spent_tokens
from cluster.providers.budget import Prices, cost_usd
from cluster.routing.view import BackendView
from cluster.wire.choices import whole_response
from cluster.wire.errors import ClusterError, StreamInterrupted
from cluster.wire.logprobs import with_prompt
from cluster.wire.openai_format import SSE_DONE, full_response, sse, usage_chunk
from cluster.wire.protocol import Usage
from cluster.wire.stream import Ending, TokenStream
from deployments import metrics
from deployments.gateway import http_api as h
from deployments.gateway.attempts import AttemptRunner
from deployments.gateway.context import RequestContext, Served
from deployments.gateway.migration import Migrations, Seamless
from deployments.gateway.prepare import Prepared

BODY = "http.response.body"


@dataclass
class _Account:
    """What one request measured; recorded once when it ends."""

    t0: float
    first_at: float | None = None
    last_at: float = 0.0
    events: int = 0
    backend: str = ""
    usage: Usage | None = None
    finish: str = "stop"
    cancelled: bool = False  # the client left (the task was cancelled)
    stream: TokenStream | None = None  # the winner's (it counts its events)

    def relayed(self) -> int:
        """Completion tokens relayed so far, from the counts the stream keeps anyway: an engine's
        events (one per token, or per few when a token has no text of its own), a provider's
        content chunks."""
        return self.stream.events if self.stream is not None else 0


@dataclass
class _Winner:
    """The winning attempt as the relay sees it: its stream, first item, the rest, our headers."""

    stream: TokenStream
    first: bytes
    rest: AsyncIterator[bytes]
    headers: dict[str, str]


@dataclass(frozen=True)
class RelaySettings:
    """The server settings the relay reads."""

    replica_id: str  # this gateway replica (the ``x-llmc-gateway`` header)
    timing_header: bool  # send ``server-timing`` (ClusterConfig.server.timing_header)
    idle_timeout_s: float | None  # a stream silent this long breaks (policies.stream_idle_timeout_s)


class Relay:
    """One per gateway replica. Its collaborators, given explicitly: the attempt runner (the race's
    hooks, and the routing views' end of each attempt), the SLO guard (each first token's time),
    the providers' prices (a request's cost), the migrations (a broken engine stream continued)."""

    def __init__(
        self,
        attempts: AttemptRunner,
        guard: SloGuard,
        prices: Mapping[str, Prices],
        migrations: Migrations,
        settings: RelaySettings,
    ) -> None:
        self.attempts, self.guard, self.prices = attempts, guard, prices
        self.migrations, self.settings = migrations, settings

    @classmethod
    def build(
        cls,
        cfg: ClusterConfig,
        attempts: AttemptRunner,
        guard: SloGuard,
        prices: Mapping[str, Prices],
        views: Mapping[str, BackendView],
        replica_id: str,
    ) -> Relay:
        """A gateway's relay: the settings it reads from the cluster's config, and its parts."""
        idle = cfg.policies.stream_idle_timeout_s
        migrations = Migrations(attempts, views, cfg.backend, idle)
        settings = RelaySettings(replica_id, cfg.server.timing_header, idle)
        return cls(attempts, guard, prices, migrations, settings)

    async def serve(self, ctx: RequestContext, send: h.Send) -> Served:
        """Race to the first token, relay the winner's stream, then account for it once; the
        tenant's reservation settles (``ctx.settle``) however the request ends."""
        result, acct = RaceResult(), _Account(ctx.t0)
        seams: list[Seamless] = []
        outcome = Outcome.CANCELLED
        try:
            outcome = await self._relay(ctx, send, result, acct, seams)
        except asyncio.CancelledError:
            acct.cancelled = True
            raise
        finally:
            served = self._end(ctx, result, seams, acct, outcome)
        return served

    async def _relay(
        self, ctx: RequestContext, send: h.Send, result: RaceResult, acct: _Account, seams: list[Seamless]
    ) -> Outcome:
        p, trace = ctx.prepared, ctx.trace
        hooks, deadline = self.attempts.hooks(p.req, ctx.candidates, p.meta, not p.stream, p.hashes, trace)
        try:
            winner, first = await first_token(hooks, result, deadline)
        except ClusterError as err:
            await h.send_error(send, err)
            return Outcome.ERRORED
        acct.first_at = acct.last_at = time.perf_counter()
        acct.backend = backend_of_slot(winner.planned.backend)
        if trace is not None:
            trace.first_token_ns, trace.backend = time.time_ns(), acct.backend
        self._observe_ttft(p.req.surface, acct, winner.stream.placed_at, ctx.t0)
        headers = self._headers(ctx, result, winner, acct, hooks.clock() - winner.started_at)
        rest = follow(hooks, winner, deadline, self.settings.idle_timeout_s)
        stream: TokenStream = winner.stream
        if winner.stream.emitted() is not None:  # an engine's, naming its tokens: it can migrate
            seam = Seamless(self.migrations, ctx, result, winner, rest, deadline, lambda: acct.last_at)
            seams.append(seam)
            stream, rest = seam, seam.items()
        acct.stream = stream
        w = _Winner(stream, first, rest, headers)
        if p.stream:
            return await self._stream(send, p, w, acct)
        return await self._collect(send, p, w, acct)

    def _observe_ttft(self, surface: str, acct: _Account, placed_at: float | None, t0: float) -> None:
        """The SLO guard's sample: an engine attempt's first token counted from when its replica was
        chosen, so the time the request waited before (admission, a new replica during an upgrade,
        a replica that refused it) is not taken for the engines' contention, the one thing deferring
        lower-priority work can relieve (a CI rehearsal's upgrade had 120 Chat 429s from the guard)."""
        now = time.monotonic()
        assert acct.first_at is not None
        ttft = now - placed_at if placed_at is not None else acct.first_at - t0
        self.guard.observe(surface, acct.backend, ttft, now)

    def _headers(
        self, ctx: RequestContext, result: RaceResult, winner: Attempt, acct: _Account, upstream_s: float
    ) -> dict[str, str]:
        """Our response headers: who served it, the race to its first token, and its timing."""
        headers = {
            "x-llmc-gateway": self.settings.replica_id,
            "x-llmc-backend": acct.backend,
            "x-llmc-replica": winner.stream.replica or "",
            # the race to the first token: attempts started, and whether a hedge won it
            "x-llmc-attempts": str(len(result.attempts)),
            "x-llmc-hedge-won": "1" if winner.hedge else "0",
        }
        headers.update(ctx.prepared.length_headers())  # a configured limit, not the client, set the length
        if self.settings.timing_header:
            assert acct.first_at is not None
            ttft = acct.first_at - ctx.t0
            headers["server-timing"] = server_timing(ctx.prepared.prep_s, ctx.waited_s, upstream_s, ttft)
        return headers

    def _end(
        self,
        ctx: RequestContext,
        result: RaceResult,
        seams: list[Seamless],
        acct: _Account,
        outcome: Outcome,
    ) -> Served:
        """Every attempt is over: the routing views stop counting them, the metrics are recorded,
        the tenant's reservation settles."""
        self.attempts.finished(result)
        for seam in seams:
            for more in seam.results:
                self.attempts.finished(more)
        cost = self._record(ctx, acct)
        sent = acct.first_at is not None or (acct.cancelled and bool(result.attempts))
        spent = spent_tokens(acct.usage, len(ctx.prepared.req.prompt_token_ids), acct.relayed(), sent)
        if ctx.settle is not None:
            ctx.settle(spent)
        finish = acct.finish if acct.first_at is not None else None
        if ctx.trace is not None:
            ctx.trace.usage, ctx.trace.finish = acct.usage, finish
        return Served(outcome, acct.usage, cost, finish, spent)

    async def _stream(self, send: h.Send, p: Prepared, w: _Winner, acct: _Account) -> Outcome:
        stream, rest = w.stream, w.rest
        await h.start_sse(send, w.headers)
        clock = time.perf_counter
        data: bytes | None = w.first
        last = b""  # the finish event leaves with the tail, in one write
        try:
            while data is not None:
                if data:
                    if stream.finish_held:
                        last += data
                    else:
                        await send({"type": BODY, "body": data, "more_body": True})
                acct.last_at = clock()
                data = await anext(rest, None)
        except StreamInterrupted as err:
            self._settle(stream, acct)
            await send({"type": BODY, "body": last + sse(err.to_openai()) + SSE_DONE, "more_body": False})
            return Outcome.ERRORED
        self._settle(stream, acct)
        tail = SSE_DONE
        if p.include_usage and acct.usage is not None:
            tail = sse(usage_chunk(p.meta, acct.usage)) + SSE_DONE
        await send({"type": BODY, "body": last + tail, "more_body": False})
        return Outcome.COMPLETED

    async def _collect(self, send: h.Send, p: Prepared, w: _Winner, acct: _Account) -> Outcome:
        data: bytes | None = w.first
        try:
            while data is not None:  # the stream keeps what the answer needs
                acct.last_at = time.perf_counter()
                data = await anext(w.rest, None)
        except StreamInterrupted as err:
            self._settle(w.stream, acct)
            await h.send_error(send, err)
            return Outcome.ERRORED
        end = self._settle(w.stream, acct) or Ending()
        usage = acct.usage or Usage()
        if end.choices:  # n > 1: each choice as the stream collected it
            body = whole_response(p.meta, end.choices, usage)
        else:
            body = full_response(
                p.meta, end.text, acct.finish, usage, end.tool_calls, end.thinking, end.logprobs
            )
        if end.prompt_logprobs is not None:  # vLLM's, asked for
            body = with_prompt(body, end.prompt_logprobs)
        await h.send_json(send, 200, body, w.headers)
        return Outcome.COMPLETED

    @staticmethod
    def _settle(stream: TokenStream, acct: _Account) -> Ending | None:
        """How the stream ended, into the account (None: it broke before saying)."""
        end = stream.ending()
        if end is None:
            acct.usage, acct.finish, acct.events = None, "stop", 0
        else:
            acct.usage, acct.finish, acct.events = end.usage, end.finish_reason, stream.events
        return end

    def _record(self, ctx: RequestContext, acct: _Account) -> float:
        """The request's metrics, once; its cost (a provider's price of its usage, else 0)."""
        surface = ctx.prepared.req.surface
        metrics.ADMISSIONS.inc(tags={"surface": surface})
        metrics.QUEUE_WAIT.observe(ctx.waited_s, tags={"surface": surface})
        now = time.perf_counter()
        if acct.first_at is None:
            return 0.0
        metrics.TTFT.observe(acct.first_at - acct.t0, tags={"surface": surface, "backend": acct.backend})
        if acct.events > 1:  # the mean gap between this request's chunks
            metrics.ITL.observe((acct.last_at - acct.first_at) / (acct.events - 1), tags={"surface": surface})
        cost = 0.0
        if acct.usage is not None:
            metrics.record_usage(surface, acct.backend, acct.usage)
            prices = self.prices.get(acct.backend)
            if prices is not None and (cost := cost_usd(acct.usage, prices)) > 0:
                tags = {"surface": surface, "backend": acct.backend, "outcome": "completed"}
                metrics.COST.inc(cost, tags=tags)
            metrics.LATENCY.observe(now - acct.t0, tags={"surface": surface, "outcome": "completed"})
        return cost
