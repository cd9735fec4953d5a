"""The token path of one request, in the gateway: the first-token race, then the winner's stream
to the client, then the accounting.

An engine replica's stream arrives as the client's own SSE bytes and is passed through as read; a
provider adapter's typed chunks are framed here (:mod:`cluster.wire.openai_format`, the one SSE
writer). Per chunk: one read, one ``send``, a clock stamp. No task, no timer (one watchdog per
stream, in :func:`cluster.policy.race.follow`), no metrics call: those come once, at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.config import ClusterConfig
from cluster.observability.server_timing import server_timing
from cluster.policy.admission import Outcome
from cluster.policy.attempts import backend_of_slot
from cluster.policy.race import Attempt, RaceResult, first_token, follow
from cluster.policy.slo_guard import SloGuard
from cluster.policy.tenants import spent_tokens
from cluster.providers.budget import Prices, cost_usd
from cluster.routing.view import BackendView
from cluster.wire.choices import ChoiceEvents, whole_response
from cluster.wire.errors import ClusterError, StreamInterrupted
from cluster.wire.logprobs import LogprobsFraming, with_prompt
from cluster.wire.openai_format import SSE_DONE, TextEvents, full_response, sse, stream_chunk, usage_chunk
from cluster.wire.protocol import Chunk, Usage
from cluster.wire.thinking import ThinkingAccumulator
from cluster.wire.tool_calls import ToolCallAccumulator
from deployments import http_api as h
from deployments import metrics
from deployments.attempts import AttemptRunner
from deployments.context import RequestContext, Served
from deployments.migration import Migrations, Seamless
from deployments.prepare import Prepared

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
    stream: Any = None  # the winner's stream (an engine's counts its events), and the framer
    framer: _Framer | None = None  # (a provider's chunks: it counts their tokens)

    def relayed(self) -> int:
        """Completion tokens relayed so far, from the counts the relay keeps anyway: an engine's
        events (one per token, or per few when a token has no text of its own), a provider's text
        chunks."""
        events = getattr(self.stream, "events", None)
        if events is not None:
            return int(events)
        return self.framer.tokens if self.framer is not None else 0


@dataclass
class _Winner:
    """The winning attempt as the relay sees it: its stream, first item, the rest, our headers."""

    stream: Any
    first: Any
    rest: Any
    headers: dict[str, str]


class _Framer:
    """Frames a provider's chunks as the client's SSE events (engines send them framed); a batch
    (what one network read brought) becomes one write."""

    def __init__(self, prepared: Prepared, n: int = 1) -> None:
        self.meta = prepared.meta
        self.text_events = TextEvents(prepared.meta)
        self.sent_first = False
        self.finished = False  # the finish event is framed: only the stream's tail comes after it
        self.parts: list[str] = []
        self.usage: Usage | None = None
        self.finish = "stop"
        self.tokens = 0
        self.tool_calls = ToolCallAccumulator()
        self.thinking = ThinkingAccumulator()
        self.logprobs = LogprobsFraming(prepared.meta.kind, collect=True)  # a provider's, if it sent any
        self.choices = ChoiceEvents(prepared.meta, n, collect=True) if n > 1 else None

    def frame(self, batch: list[Chunk]) -> bytes:
        if len(batch) == 1:
            return self.frame_one(batch[0])
        return b"".join([self.frame_one(c) for c in batch])

    def frame_one(self, chunk: Chunk) -> bytes:
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.finish_reason is not None:
            self.finish = chunk.finish_reason
        if self.choices is not None:  # n > 1: each chunk's event names its choice
            return self._choice_event(chunk, self.choices)
        calls, thinking = chunk.tool_calls, chunk.thinking
        self.logprobs.add(chunk.logprobs)  # they ride on the next event, as an engine's do
        if not (chunk.text or calls or thinking or chunk.finish_reason is not None or not self.sent_first):
            return b""
        if chunk.text or calls or thinking:
            self.tokens += 1
            self.parts.append(chunk.text)
        if calls:
            self.tool_calls.feed(calls)
        if thinking:
            self.thinking.feed(thinking)
        lp = self.logprobs.take()
        if not (calls or thinking or lp) and self.sent_first and chunk.finish_reason is None:
            return self.text_events.event(chunk.text)  # the common case: text, nothing else
        first = not self.sent_first
        self.finished = chunk.finish_reason is not None
        c = stream_chunk(self.meta, chunk.text, chunk.finish_reason, first, calls, thinking, lp)
        data = sse(c)
        self.sent_first = True
        return data

    def _choice_event(self, chunk: Chunk, choices: ChoiceEvents) -> bytes:
        if chunk.text or chunk.tool_calls:
            self.tokens += 1
        data = choices.event(chunk)
        self.finish = choices.finish_reason
        self.sent_first = self.sent_first or bool(data)
        return data


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
        result, acct, seams = RaceResult(), _Account(ctx.t0), []
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
        self.guard.observe(p.req.surface, acct.backend, acct.first_at - ctx.t0, time.monotonic())
        headers = self._headers(ctx, result, winner, acct, hooks.clock() - winner.started_at)
        rest = follow(hooks, winner, deadline, self.settings.idle_timeout_s)
        stream = winner.stream
        if getattr(stream, "passed", None) is not None:  # an engine's, with its token ids
            seam = Seamless(self.migrations, ctx, result, winner, rest, deadline, lambda: acct.last_at)
            seams.append(seam)
            stream, rest = seam, seam.items()
        framer = _Framer(p, p.req.sampling.n)
        acct.stream, acct.framer = stream, framer
        w = _Winner(stream, first, rest, headers)
        if p.stream:
            return await self._stream(send, p, w, framer, acct)
        return await self._collect(send, p, w, framer, acct)

    def _headers(
        self, ctx: RequestContext, result: RaceResult, winner: Attempt, acct: _Account, upstream_s: float
    ) -> dict[str, str]:
        """Our response headers: who served it, the race to its first token, and its timing."""
        headers = {
            "x-llmc-gateway": self.settings.replica_id,
            "x-llmc-backend": acct.backend,
            "x-llmc-replica": getattr(winner.stream, "replica", None) or "",
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

    async def _stream(
        self, send: h.Send, p: Prepared, w: _Winner, framer: _Framer, acct: _Account
    ) -> Outcome:
        stream, first, rest, headers = w.stream, w.first, w.rest, w.headers
        await h.start_sse(send, headers)
        clock = time.perf_counter
        item = first
        last = b""  # the finish event leaves with the tail, in one write
        try:
            while True:
                data = item if isinstance(item, bytes) else framer.frame(item)
                if data:
                    if framer.finished:
                        last += data
                    else:
                        await send({"type": BODY, "body": data, "more_body": True})
                acct.last_at = clock()
                item = await anext(rest, None)
                if item is None:
                    break
        except StreamInterrupted as err:
            self._settle(stream, framer, acct)
            await send({"type": BODY, "body": last + sse(err.to_openai()) + SSE_DONE, "more_body": False})
            return Outcome.ERRORED
        self._settle(stream, framer, acct)
        tail = SSE_DONE
        if p.include_usage and acct.usage is not None:
            tail = sse(usage_chunk(p.meta, acct.usage)) + SSE_DONE
        await send({"type": BODY, "body": last + tail, "more_body": False})
        return Outcome.COMPLETED

    async def _collect(
        self, send: h.Send, p: Prepared, w: _Winner, framer: _Framer, acct: _Account
    ) -> Outcome:
        stream, first, rest, headers = w.stream, w.first, w.rest, w.headers
        item = first
        try:
            while item is not None:
                if not isinstance(item, bytes):
                    framer.frame(item)
                acct.last_at = time.perf_counter()
                item = await anext(rest, None)
        except StreamInterrupted as err:
            self._settle(stream, framer, acct)
            await h.send_error(send, err)
            return Outcome.ERRORED
        self._settle(stream, framer, acct)
        end = getattr(stream, "end", None)
        text = end.text if end is not None and end.text is not None else "".join(framer.parts)
        calls = end.tool_calls if end is not None and end.tool_calls else framer.tool_calls.calls()
        logprobs = end.logprobs if end is not None else framer.logprobs.whole()
        body = full_response(
            p.meta, text, acct.finish, acct.usage or Usage(), calls, framer.thinking.blocks(), logprobs
        )
        if end is not None and end.choices:  # n > 1 on an engine: each choice as it collected it
            body = whole_response(p.meta, end.choices, acct.usage or Usage())
        elif framer.choices is not None:  # n > 1 from a provider
            body = whole_response(p.meta, framer.choices.whole(), acct.usage or Usage())
        if end is not None and end.prompt_logprobs is not None:  # vLLM's, asked for
            body = with_prompt(body, end.prompt_logprobs)
        await h.send_json(send, 200, body, headers)
        return Outcome.COMPLETED

    @staticmethod
    def _settle(stream: Any, framer: _Framer, acct: _Account) -> None:
        end = getattr(stream, "end", None)
        if end is not None:  # an engine: its end frame has the usage
            acct.usage, acct.finish = end.usage, end.finish_reason
            acct.events = stream.events
        else:
            acct.usage, acct.finish, acct.events = framer.usage, framer.finish, framer.tokens

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
