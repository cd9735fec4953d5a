"""Mid-stream migration in the gateway: a self-hosted stream that breaks after its first token
(its replica died, drained or went silent) goes on from another replica, and the client sees one
uninterrupted stream.

:class:`Seamless` wraps the winning attempt's items for the relay. When they end with
:class:`StreamInterrupted`, it reads back what the broken stream sent (the token ids ride in the
events, :func:`cluster.wire.engine_stream.parse_emitted`), asks the pure policy
(:mod:`cluster.policy.migration`) whether to continue, and races the continuation (prompt + tokens sent,
the remaining ``max_tokens``, same sampling and seed) over the same model's self-hosted
candidates with the same routing policy, which sees the continuation's prefix and avoids the
broken replica. Its stream was asked not to repeat the role delta, so its bytes pass through as
the rest of the client's stream. Usage counts each token once for the client; the re-prefill is
counted apart (``llmc_migration_prefill_tokens_total`` and ``llmc_tokens_total`` with outcome
``migrated``). Nothing here runs per chunk but the generator hop; everything else runs only when
a stream breaks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from cluster.config import BackendConfig
from cluster.policy.attempts import backend_of_slot
from cluster.policy.migration import Break, classify, client_usage, continuation
from cluster.policy.race import Attempt, RaceResult, first_token, follow
from cluster.routing.block_hash import BlockHash
from cluster.routing.view import BackendView
from cluster.wire.engine_stream import Emitted
from cluster.wire.errors import ClusterError, StreamInterrupted
from cluster.wire.protocol import GenerateRequest, Usage
from cluster.wire.stream import AttemptStream, Ending
from deployments import metrics
from deployments.gateway.attempts import AttemptRunner, Continuing
from deployments.gateway.context import RequestContext

# The stream goes on elsewhere (its first item, the rest); "done": the broken stream had already
# sent its last token, nothing to continue; None: the break stands
_Next = tuple[bytes, AsyncIterator[bytes]] | Literal["done"] | None


@dataclass(frozen=True)
class Migrations:
    """What every migration in a gateway uses, given explicitly: the attempt runner (the
    continuation's race, the migration policy and its counters), the routing views (the
    continuation's prefix hashes), the backends' configs, and the stream idle timeout."""

    attempts: AttemptRunner
    views: Mapping[str, BackendView]
    backend: Callable[[str], BackendConfig]
    idle_timeout_s: float | None


class Seamless:
    """One request's token stream across its migrations; stands in for the winner's stream in the
    relay (a :class:`cluster.wire.stream.TokenStream`: its ending, events, replica)."""

    def __init__(
        self,
        parts: Migrations,
        ctx: RequestContext,
        result: RaceResult,
        winner: Attempt,
        rest: AsyncIterator[bytes],
        deadline: float | None,
        last_token_at: Callable[[], float],  # the relay's stamp of the last token it relayed
    ) -> None:
        self.parts, self.ctx, self.p, self.deadline = parts, ctx, ctx.prepared, deadline
        self.last_token_at = last_token_at
        self.stream: AttemptStream = winner.stream
        self.backend = backend_of_slot(winner.planned.backend)
        self.rest = rest
        self.results: list[RaceResult] = []  # the continuations' races (the relay ends them)
        self.attempts = len(result.attempts)
        self.ids: list[int] = []  # the tokens the client got from earlier streams
        self.text: list[str] = []
        self.events_before = 0
        self.migrations = 0
        self.broken: list[str] = []  # replicas whose streams broke
        self._end: Ending | None = None

    # -- the stream, as the relay sees it -------------------------------------------------------
    @property
    def replica(self) -> str | None:
        return self.stream.replica

    @property
    def events(self) -> int:
        return self.events_before + self.stream.events

    @property
    def finish_held(self) -> bool:
        return self.stream.finish_held

    def ending(self) -> Ending | None:
        if self._end is not None:
            return self._end
        last = self.stream.ending()
        if last is None or self.migrations == 0:
            return last
        usage = client_usage(len(self.p.req.prompt_token_ids), len(self.ids), last.usage or Usage())
        return Ending(last.finish_reason, usage, "".join(self.text) + last.text)

    async def items(self) -> AsyncIterator[bytes]:
        rest = self.rest
        while True:
            try:
                async for item in rest:
                    yield item
                return
            except StreamInterrupted as err:
                nxt = await self._migrate(err)
                if nxt is None:
                    raise
                if nxt == "done":
                    return
                first, rest = nxt
                yield first

    # -- a break ------------------------------------------------------------------------------
    async def _migrate(self, err: StreamInterrupted) -> _Next:
        """Continue elsewhere: (first item, the rest), "done", or None (the error stands)."""
        stream, req = self.stream, self.p.req
        named = stream.emitted()  # None: it did not name its tokens
        emitted = named if named is not None else Emitted()
        sent = self.ids + emitted.ids
        if emitted.finish_reason is not None or len(sent) >= req.sampling.max_tokens:
            self._finished(emitted, sent)  # only the end frame was lost
            return "done"
        reason = classify(stream.fault, err)
        now = time.monotonic()
        brk = Break(
            reason,
            self.parts.backend(self.backend).kind,
            self.migrations,
            named is not None and (bool(emitted.ids) or emitted.events == 0),
            None if self.deadline is None else self.deadline - now,
        )
        decision = self.parts.attempts.migration.decide(req, brk, now)
        if not decision.allowed:
            self._count(reason, decision.why)
            return None
        cont = continuation(req, sent, self.attempts)
        started = await self._race(cont, stream)
        if started is None:
            self._count(reason, "failed")
            return None
        winner, first = started
        metrics.MIGRATION_SEAM.observe(
            time.perf_counter() - self.last_token_at(), tags={"backend": self.backend}
        )
        self._count(reason, "migrated")
        self._moved(winner, emitted, sent, len(cont.prompt_token_ids))
        return first, follow(self._hooks, winner, self.deadline, self.parts.idle_timeout_s)

    async def _race(self, cont: GenerateRequest, broken: AttemptStream) -> tuple[Attempt, bytes] | None:
        """The continuation's first-token race on the same model's self-hosted candidates."""
        parts = self.parts
        if broken.replica:
            self.broken.append(broken.replica)
        hashed: dict[str, list[BlockHash]] = {}

        def hashes(backend: str) -> list[BlockHash]:  # affinity sees the continuation's whole prefix
            view = parts.views.get(backend)
            if view is None or view.policy is None:
                return []
            if backend not in hashed:
                hashed[backend] = view.policy.hash(cont.prompt_token_ids, cont.cache_salt)
            return hashed[backend]

        hooks, _ = parts.attempts.hooks(
            cont,
            self._candidates(),
            self.p.meta,
            not self.p.stream,
            hashes,
            self.ctx.trace,
            Continuing(self.attempts, tuple(self.broken)),
        )
        self._hooks = hooks
        result = RaceResult()
        self.results.append(result)
        try:
            return await first_token(hooks, result, self.deadline)
        except ClusterError:
            return None
        finally:
            self.attempts += len(result.attempts)

    def _candidates(self) -> list[str]:
        """The request's candidates that serve the broken backend's model on our own engines."""
        config = self.parts.backend
        model = config(self.backend).model
        rest = [
            c
            for c in self.p.candidates
            if c != self.backend and config(c).kind.caps.migratable and config(c).model == model
        ]
        return [self.backend, *rest]

    def _moved(self, winner: Attempt, emitted: Emitted, sent: list[int], prompt: int) -> None:
        self.events_before += self.stream.events
        self.ids, self.text = sent, self.text + emitted.text
        self.migrations += 1
        self.stream = winner.stream
        tags = {"backend": self.backend}
        metrics.MIGRATION_PREFILL.inc(prompt, tags=tags)
        metrics.record_usage(self.p.req.surface, self.backend, Usage(prompt, 0, 0), outcome="migrated")

    def _finished(self, emitted: Emitted, sent: list[int]) -> None:
        self.events_before += self.stream.events
        self.text += emitted.text
        usage = Usage(len(self.p.req.prompt_token_ids), len(sent), 0)
        self._end = Ending(emitted.finish_reason or "length", usage, "".join(self.text))

    def _count(self, reason: str, outcome: str) -> None:
        self.parts.attempts.migrated[f"{reason}:{outcome}"] += 1
        metrics.MIGRATIONS.inc(tags={"backend": self.backend, "reason": reason, "outcome": outcome})
