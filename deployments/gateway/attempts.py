"""The gateway's attempts for one request, wired: the race (:mod:`cluster.policy.race`) gets hooks that
start the two kinds of attempt the gateway makes in its own process, an HTTP stream from an
engine replica (:class:`EngineStream`, pass-through bytes) or a provider adapter
(:class:`ProviderBackend`, batches of typed chunks), and verdicts applied to the breakers, the
hedge policy and the metrics by the pure rules of :mod:`cluster.policy.attempts`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from cluster.config import ClusterConfig, SurfaceConfig
from cluster.json_types import JSONObject
from cluster.observability.trace import AttemptSpans, AttemptTrace, RequestTrace
from cluster.policy.attempts import avoid_replicas, backend_of_slot, effects, error_code, expand_slots
from cluster.policy.brownout import Brownout
from cluster.policy.failover import BreakerBoard, CircuitBreaker, FailoverPlan, PlannedAttempt, RetryBudget
from cluster.policy.hedging import HedgePolicy
from cluster.policy.migration import MigrationPolicy
from cluster.policy.race import Attempt, RaceHooks, RaceResult, Verdict
from cluster.routing.block_hash import BlockHash
from cluster.wire.engine_stream import request_body
from cluster.wire.framing import ChunkFramer, FramedStream
from cluster.wire.openai_format import ResponseMeta
from cluster.wire.protocol import GenerateRequest
from cluster.wire.stream import AttemptStream
from deployments import metrics
from deployments.gateway.engine_client import EngineStream, ReplicaLease, ReplicaPicker

if TYPE_CHECKING:  # the adapters are imported where a provider backend is configured
    from deployments.providers.providers import ProviderBackend


async def close_stream(stream: AttemptStream) -> None:
    """Stop an attempt's stream: closing it aborts the work upstream (engine or provider)."""
    with contextlib.suppress(Exception):
        await stream.aclose()


@dataclass(frozen=True)
class Continuing:
    """A continuation's race: its attempts are numbered from ``attempt_base`` (engine ids stay
    unique per attempt) and avoid the replicas whose streams broke."""

    attempt_base: int
    avoid: tuple[str, ...] = ()


def _capacity_wait_until(surface: SurfaceConfig | None) -> float:
    """With no replica able to take it, a request's engine attempts wait for a replacement as long
    as it could have waited in its surface's queue, all together (then 503 no_capacity); not at
    all when another of its candidates can take it at once (:meth:`AttemptRunner.elsewhere`)."""
    wait = surface.queue_deadline_ms / 1000 if surface is not None else 0.0
    return time.monotonic() + wait


@dataclass(slots=True)
class HedgeState:
    """One race's hedge, written by its hedge check (``may_hedge``) alone and read by its next
    attempt and its unsent hedge."""

    escape: bool = False  # the hedge is a brownout's race: to another backend than the first's
    paid: bool = False  # the hedge budget paid for it
    refused: bool = False  # the hedge budget said no once already


def _next_attempts(
    plan: FailoverPlan, breakers: Mapping[str, CircuitBreaker], slots: list[str], state: HedgeState
) -> Callable[[bool], PlannedAttempt | None]:
    """The race's next attempt from ``plan``; a brownout's race (``state.escape``, set by the hedge
    check) passes over the first backend's other slots: it escapes the backend, not its replica."""
    first = backend_of_slot(slots[0]) if slots else ""

    def next_attempt(hedge: bool) -> PlannedAttempt | None:
        skip = (lambda x: backend_of_slot(x) == first) if hedge and state.escape else None
        return plan.next(time.monotonic(), breakers, hedge=hedge, skip=skip)

    return next_attempt


class AttemptRunner:
    """One per gateway process: the breakers, the retry budget and the hedge policy it feeds."""

    def __init__(
        self,
        cfg: ClusterConfig,
        pickers: dict[str, ReplicaPicker],
        providers: Mapping[str, ProviderBackend],
        session: Callable[[], aiohttp.ClientSession],
        token: str,
        board: BreakerBoard,
    ) -> None:
        self.cfg, self.pickers, self.providers = cfg, pickers, providers
        self.session, self.token, self.board = session, token, board
        self.retry_budget = RetryBudget(cfg.policies.failover.retry_budget)
        self.migration = MigrationPolicy(cfg.policies.migration)
        self.ids = self.migration.config.enabled  # engines name their tokens: a break can migrate
        self.hedge = HedgePolicy(cfg.policies.hedging)
        self.brownout = Brownout(cfg.policies.brownout)  # a backend far slower than its usual goes last
        self.failovers: Counter[str] = Counter()  # by backend: attempts abandoned before a token
        self.broken: Counter[str] = Counter()  # by backend: streams that broke after a token
        self.migrated: Counter[str] = Counter()  # by "reason:outcome": what became of those breaks
        self.rng = random.Random()  # span ids
        self.providers_api = {b.name: b.provider.api for b in cfg.backends if b.provider is not None}
        self.kinds = {b.name: b.kind for b in cfg.backends}

    def slots(self, candidates: list[str]) -> list[str]:
        return expand_slots(candidates, self.cfg.backend)

    def hooks(
        self,
        req: GenerateRequest,
        candidates: list[str],
        meta: ResponseMeta,
        collect: bool,
        hashes: Callable[[str], list[BlockHash]],
        trace: RequestTrace | None = None,
        cont: Continuing | None = None,
    ) -> tuple[RaceHooks, float | None]:
        """The race's hooks for one request, and its deadline on the monotonic clock; with a trace,
        each attempt and its routing decision are recorded in it (never per chunk). ``cont``: a
        continuation's race (no hedge, no new request for the budgets, see :class:`Continuing`)."""
        surface = self.cfg.surface(req.surface)
        hedging = bool(surface and surface.hedging) and cont is None
        slots = self.slots(candidates)
        breakers = {s: self.board.backend(backend_of_slot(s)) for s in slots}
        mono_deadline = None if req.deadline is None else time.monotonic() + (req.deadline - time.time())
        self._new_request(cont)
        base, avoid = (cont.attempt_base, cont.avoid) if cont is not None else (0, ())
        plan = FailoverPlan(slots, mono_deadline, self.cfg.policies.failover, self.retry_budget)
        spans = AttemptSpans(trace, self.rng)
        wait_until = _capacity_wait_until(surface)

        def start(planned: PlannedAttempt, hedge: bool, prior: list[Attempt]) -> AttemptStream:
            backend = backend_of_slot(planned.backend)
            self._count_attempt(backend, planned.attempt, hedge)
            attempt_req = dataclasses.replace(req, attempt=base + planned.attempt)
            kind: str = self.providers_api.get(backend) or self.kinds.get(backend) or ""
            at = spans.start(id(planned), backend, kind, attempt_req.attempt, hedge, time.time_ns())
            if backend in self.providers:
                return self._provider_stream(backend, attempt_req, meta)
            body = request_body(attempt_req, meta, collect, ids=self.ids, continued=cont is not None)
            return self._engine_stream(
                backend, attempt_req, body, hashes(backend), prior, spans, at, avoid, wait_until, candidates
            )

        state = HedgeState()
        hedge_delay, may_hedge, hedge_unsent = self._hedging(req.surface, hedging, slots, cont, state)

        def verdict(att: Attempt, v: Verdict, err: BaseException | None, dt: float) -> None:
            self._verdict(req, att, v, err, dt, cont is None, slots[0])  # a re-prefill is no TTFT
            code = None if err is None else error_code(err) or type(err).__name__
            spans.ended(id(att.planned), v, code, time.time_ns())

        hooks = RaceHooks(
            next_attempt=_next_attempts(plan, breakers, slots, state),
            start=start,
            cancel=close_stream,
            hedge_delay=hedge_delay,
            may_hedge=may_hedge,
            hedge_unsent=hedge_unsent,
            hedge_recheck_s=self.brownout.cfg.recheck_s
            if cont is None and self.brownout.cfg.enabled
            else None,
            verdict=verdict,
        )
        return hooks, mono_deadline

    def _hedging(
        self,
        surface: str,
        hedging: bool,
        slots: list[str],
        cont: Continuing | None,
        state: HedgeState | None = None,
    ) -> tuple[Callable[[PlannedAttempt], float | None], Callable[[float, int], bool], Callable[[], None]]:
        """The race's hedge delay, its hedge check and what an unsent hedge gives back. The delay is
        the TTFT quantile, at most the brownout's slow threshold (in a brownout the quantile climbs
        to the slow first tokens themselves). Outside the hedge budget: a brownout's probe races
        the next candidate once it is as slow as a brownout, on any surface
        (:meth:`Brownout.probe_hedge_delay`); and a request past its hedge delay that the budget
        refused races it as soon as its backend is demoted (the race asks again every
        ``brownout.recheck_s``), on any surface, hedging or not, as a probe does: the requests
        sent to a backend in the moments before its brownout was seen do not wait it out."""
        primary = backend_of_slot(slots[0]) if slots else ""
        probe = None if cont is not None else self.brownout.probe_hedge_delay(surface, primary)
        # a demoted backend's race escapes it only to another backend: the next slot being another
        # replica of the same one (a self-hosted backend alone on its route, whose first tokens vary
        # with the cache) sent every slow request to a replica without its context (bench_affinity
        # fits: hit rate 0.80 -> 0.71)
        escapes = any(backend_of_slot(x) != primary for x in slots)
        brownout = cont is None and self.brownout.cfg.enabled
        st = state if state is not None else HedgeState()

        def hedge_delay(first: PlannedAttempt) -> float | None:
            if probe is not None:
                return probe
            backend = backend_of_slot(first.backend)
            cap = self.brownout.slow_threshold(surface, backend) if brownout else None
            if not hedging:
                return cap  # no hedges here: only a demoted backend's race, from the slow threshold
            delay = self.hedge.delay(surface, backend, time.monotonic())
            return delay if delay is None or cap is None else min(delay, cap)

        def may_hedge(elapsed: float, sent: int) -> bool:
            if probe is not None:
                return sent == 0
            if sent == 0 and brownout and escapes and self.brownout.demoted(primary, time.monotonic()):
                st.escape = True  # the race's next slot: another backend's (hooks' next_attempt)
                return True
            if not hedging or st.refused:
                return False  # asked again only to see a demotion: the budget said no already
            st.paid = self.hedge.should_hedge(hedging, elapsed, elapsed, sent)
            st.refused = not st.paid
            return st.paid

        def hedge_unsent() -> None:
            if st.paid:  # only a hedge the budget paid for gives its token back
                self.hedge.unsent()

        return hedge_delay, may_hedge, hedge_unsent

    def _new_request(self, cont: Continuing | None) -> None:
        """A request starts: the budgets count it (a continuation is no new request)."""
        if cont is not None:
            return
        self.retry_budget.deposit(time.monotonic())
        self.hedge.on_request()
        self.migration.on_request(time.monotonic())

    def _provider_stream(self, backend: str, req: GenerateRequest, meta: ResponseMeta) -> FramedStream:
        """An attempt on a provider adapter: its typed chunks, framed as the client's events."""
        framer = ChunkFramer(meta, req.sampling.n)
        return FramedStream(self.providers[backend].generate_framed(req, framer.frame), framer)

    def _engine_stream(
        self,
        backend: str,
        req: GenerateRequest,
        body: JSONObject,
        block_hashes: list[BlockHash],
        prior: list[Attempt],
        spans: AttemptSpans,
        at: AttemptTrace | None,
        broken: Sequence[str] = (),
        wait_until: float | None = None,
        candidates: Sequence[str] = (),
    ) -> EngineStream:
        """An attempt on one of the backend's engine replicas, chosen when the stream opens."""
        avoid = avoid_replicas(backend, [(a.planned.backend, a.stream.replica) for a in prior]) + list(broken)
        picker = self.pickers[backend]
        surface = self.cfg.surface(req.surface)
        busy = surface.avoid_prefill_tokens if surface is not None else None

        def elsewhere() -> bool:
            return self.elsewhere(backend, candidates, prior, time.monotonic())

        async def choose() -> ReplicaLease:
            prompt = len(req.prompt_token_ids)
            sid = req.session_id
            lease = await picker.pick(block_hashes, sid, avoid, busy, wait_until, prompt, elsewhere)
            choice = lease.choice
            self.board.admit(backend, choice.replica, time.monotonic())  # a half-open probe, if one
            body["req"]["cache_rank"] = choice.cache_rank  # the engine queues hits before misses
            reason = picker.view.mode if picker.view.mode != "cache_aware" else choice.decision.reason
            metrics.ROUTING.inc(tags={"backend": backend, "reason": reason})
            spans.routed(at, choice.replica, reason)
            return lease

        return EngineStream(self.session(), self.token, body, backend, choose, spans.traceparent(at))

    def elsewhere(self, backend: str, candidates: Sequence[str], prior: list[Attempt], now: float) -> bool:
        """Whether a candidate of the request other than ``backend``, not tried yet, can take it at
        once: a provider its breaker lets through, or an engine backend with a ready replica. An
        attempt on ``backend`` with no replica to take it then fails over instead of waiting."""
        tried = {backend_of_slot(a.planned.backend) for a in prior}
        for c in candidates:
            if c == backend or c in tried:
                continue
            if c in self.providers:
                if self.board.backend(c).available(now):
                    return True
            elif (picker := self.pickers.get(c)) is not None and picker.ready(now):
                return True
        return False

    def _count_attempt(self, backend: str, attempt: int, hedge: bool) -> None:
        if attempt > 0 and not hedge:  # hedges are counted when the budget allows them
            self.hedge.stats.on_retry()
            metrics.ATTEMPTS.inc(tags={"backend": backend, "kind": "retry"})
        if hedge:
            metrics.ATTEMPTS.inc(tags={"backend": backend, "kind": "hedge"})
            metrics.HEDGES.inc(tags={"backend": backend, "outcome": "sent"})

    def finished(self, result: RaceResult) -> None:
        """Every attempt of a request is over: the routing views stop counting them."""
        for att in result.attempts:
            att.stream.finished()

    def _verdict(
        self,
        req: GenerateRequest,
        att: Attempt,
        v: Verdict,
        err: BaseException | None,
        dt: float,
        observe: bool = True,
        primary: str | None = None,  # the request's first slot
    ) -> None:
        if v == "won":  # its prefill is done: the replica no longer counts it as prefilling
            att.stream.won()
        now = time.monotonic()
        backend = backend_of_slot(att.planned.backend)
        fx = effects(v, err, att.hedge)
        if fx.breaker is None:
            self.board.backend(backend).release(now)
        else:
            self.board.record(backend, att.stream.replica, fx.breaker, now)
        if fx.observe_ttft and observe:
            self.hedge.observe_ttft(req.surface, backend, dt, now)
            self.brownout.observe(req.surface, backend, dt, now, complete=v == "won")
        if fx.broken:
            self.broken[backend] += 1
        if fx.failover:
            self.failovers[backend] += 1
            metrics.FAILOVERS.inc(tags={"backend": backend, "code": error_code(err)})
        if fx.hedge_won and primary is not None:  # the primary was still waiting: a brownout's evidence
            self.brownout.hedge_won(req.surface, backend_of_slot(primary), now)
        if fx.hedge_won is not None:
            self.hedge.stats.on_hedge_result(fx.hedge_won)
            outcome = "won" if fx.hedge_won else "cancelled"
            metrics.HEDGES.inc(tags={"backend": backend, "outcome": outcome})

    def snapshot(self) -> JSONObject:
        now = time.monotonic()
        s = self.hedge.stats
        return {
            "breakers": [{"backend": b, "replica": r, "state": st} for b, r, st in self.board.metrics(now)],
            "hedge_tokens": self.hedge.budget.tokens,
            "hedges_sent": s.hedges_sent,
            "hedges_won": s.hedges_won,
            "hedges_cancelled": s.hedges_cancelled,
            "hedges_refused": s.hedges_refused,
            "hedges_unplaced": s.hedges_unplaced,
            "hedge_delay_s": self.hedge.delays(now),
            "brownout": self.brownout.status(now),
            "requests": s.requests,
            "extra_load_ratio": s.extra_load_ratio,
            "failovers": dict(self.failovers),
            "broken_streams": dict(self.broken),
            "migrations": dict(self.migrated),
        }
