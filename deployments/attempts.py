"""The router's attempts for one request: which backend or replica next, when to hedge, and what each
attempt's outcome means for the circuit breakers, the hedge delay and the metrics. The race itself is
:func:`cluster.race.race`; this wires it to Serve handles and to the router's policy objects.

Candidates are expanded into *slots*: a self-hosted backend with more than one replica gets a second
slot (``name#2``), so a retry or a hedge can go to another replica of the same backend (the Serve
request router avoids the replicas earlier attempts went to), then on to the next backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from cluster.config import ClusterConfig
from cluster.errors import ClusterError
from cluster.failover import BreakerBoard, FailoverPlan, PlannedAttempt, RetryBudget, counts_against_backend
from cluster.hedging import HedgePolicy
from cluster.protocol import Chunk, GenerateRequest
from cluster.race import Attempt, RaceHooks, RaceResult, Verdict, race
from deployments import metrics, routing_state


def backend_of_slot(slot: str) -> str:
    return slot.split("#", 1)[0]


async def cancel_stream(stream: Any) -> None:
    """Stop a Serve response generator: Serve cancels the replica's call, which aborts upstream."""
    with contextlib.suppress(Exception):
        stream.cancel()


class AttemptRunner:
    """One per router process: the breakers, the retry budget and the hedge policy it feeds."""

    def __init__(self, cfg: ClusterConfig, handles: dict[str, DeploymentHandle]) -> None:
        self.cfg = cfg
        self.handles = handles
        self.board = BreakerBoard(cfg.policies.failover.breaker)
        routing_state.VIEW.breakers = self.board  # the Serve request router ejects replicas by it
        self.retry_budget = RetryBudget(cfg.policies.failover.retry_budget)
        self.hedge = HedgePolicy(cfg.policies.hedging)
        self.failovers: Counter[str] = Counter()  # by backend: attempts abandoned before a token
        self.broken: Counter[str] = Counter()  # by backend: streams that broke after a token

    def slots(self, candidates: list[str]) -> list[str]:
        out: list[str] = []
        for name in candidates:
            b = self.cfg.backend(name)
            out.append(name)
            replicas = b.autoscaling.max_replicas if b.autoscaling else b.replicas
            if b.kind != "provider" and replicas > 1:
                out.append(f"{name}#2")
        return out

    async def run(self, req: GenerateRequest, candidates: list[str]) -> AsyncIterator[Chunk]:
        surface = self.cfg.surface(req.surface)
        hedging = bool(surface and surface.hedging)
        slots = self.slots(candidates)
        breakers = {s: self.board.backend(backend_of_slot(s)) for s in slots}
        mono_deadline = None if req.deadline is None else time.monotonic() + (req.deadline - time.time())
        now = time.monotonic()
        self.retry_budget.record_request(now)
        self.hedge.on_request()
        plan = FailoverPlan(slots, mono_deadline, self.cfg.policies.failover, self.retry_budget)

        def start(planned: PlannedAttempt, hedge: bool, prior: list[Attempt]) -> Any:
            backend = backend_of_slot(planned.backend)
            avoid = [
                r
                for a in prior
                if backend_of_slot(a.planned.backend) == backend
                and (r := routing_state.VIEW.routed.get(f"{req.request_id}/{a.planned.attempt}"))
            ]
            attempt_req = dataclasses.replace(req, attempt=planned.attempt, exclude_replicas=avoid)
            if planned.attempt > 0 and not hedge:  # hedges are counted when the budget allows them
                self.hedge.stats.on_retry()
                metrics.ATTEMPTS.inc(tags={"backend": backend, "kind": "retry"})
            if hedge:
                metrics.ATTEMPTS.inc(tags={"backend": backend, "kind": "hedge"})
                metrics.HEDGES.inc(tags={"backend": backend, "outcome": "sent"})
            return self.handles[backend].generate.remote(attempt_req)

        def hedge_delay(first: PlannedAttempt) -> float | None:
            if not hedging:
                return None
            return self.hedge.delay(req.surface, backend_of_slot(first.backend), time.monotonic())

        def may_hedge(elapsed: float, sent: int) -> bool:
            # The race calls this once the hedge delay has passed: only the budget is left to ask.
            return self.hedge.should_hedge(hedging, elapsed, elapsed, sent)

        def verdict(att: Attempt, v: Verdict, err: BaseException | None, dt: float) -> None:
            self._verdict(req, att, v, err, dt)

        hooks = RaceHooks(
            next_attempt=lambda hedge: plan.next(time.monotonic(), breakers, hedge=hedge),
            start=start,
            cancel=cancel_stream,
            hedge_delay=hedge_delay,
            may_hedge=may_hedge,
            verdict=verdict,
        )
        result = RaceResult()
        try:
            idle = self.cfg.policies.stream_idle_timeout_s
            async for chunk in race(hooks, result, mono_deadline, idle):
                yield chunk
        finally:
            routing_state.VIEW.forget_request(req.request_id, attempts=max(1, len(result.attempts)))

    def _verdict(
        self, req: GenerateRequest, att: Attempt, v: Verdict, err: BaseException | None, dt: float
    ) -> None:
        now = time.monotonic()
        backend = backend_of_slot(att.planned.backend)
        replica = routing_state.VIEW.routed.get(f"{req.request_id}/{att.planned.attempt}")
        if v == "won":
            self.board.record(backend, replica, True, now)
            self.hedge.observe_ttft(req.surface, backend, dt, now)
            if att.hedge:
                self.hedge.stats.on_hedge_result(True)
                metrics.HEDGES.inc(tags={"backend": backend, "outcome": "won"})
        elif v == "broken":
            self.broken[backend] += 1
            self.board.record(backend, replica, False, now)
        elif v == "failed":
            code = err.code if isinstance(err, ClusterError) else type(err).__name__
            self.failovers[backend] += 1
            metrics.FAILOVERS.inc(tags={"backend": backend, "code": code or ""})
            if err is not None and counts_against_backend(err):
                self.board.record(backend, replica, False, now)
            else:
                self.board.backend(backend).release(now)
        else:  # cancelled: a lost race or the client left; its wait still says how slow it was
            self.board.backend(backend).release(now)
            self.hedge.observe_ttft(req.surface, backend, dt, now)
            if att.hedge:
                self.hedge.stats.on_hedge_result(False)
                metrics.HEDGES.inc(tags={"backend": backend, "outcome": "cancelled"})

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        s = self.hedge.stats
        return {
            "breakers": [{"backend": b, "replica": r, "state": st} for b, r, st in self.board.metrics(now)],
            "hedges_sent": s.hedges_sent,
            "hedges_won": s.hedges_won,
            "hedges_cancelled": s.hedges_cancelled,
            "requests": s.requests,
            "extra_load_ratio": s.extra_load_ratio,
            "failovers": dict(self.failovers),
            "broken_streams": dict(self.broken),
        }
