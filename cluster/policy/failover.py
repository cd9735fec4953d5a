"""Failover policy: what an error means, circuit breakers with outlier ejection, a retry budget, and
the order in which candidates are tried.

Pure code: every method takes the clock (``now``, seconds on any monotonic clock, the same one for
one object) and nothing here does I/O. The router owns one :class:`BreakerBoard` and one
:class:`RetryBudget` per process and builds a :class:`FailoverPlan` per request.

Breakers follow Envoy's outlier detection in spirit: a breaker opens on consecutive failures or
on a failure rate over a sliding window, stays open for an ejection time that doubles with each
repeat (capped), then lets a few probes through (half-open); a successful probe closes it. Only a
capped share of one backend's replicas may be ejected at once, so that a bad signal (or a bug of
ours) cannot empty a whole backend. The retry budget follows Finagle's: retries may add at most a
fixed share of the request rate, plus a small floor, so that a sick cluster is not finished off by
its own retries.

Verdicts: record a success when an attempt yields its first content token (a health signal, not a
whole generation), a failure when it raises something :func:`counts_against_backend` accepts, and
``release`` for an attempt cancelled before either (a lost hedge race, a client gone).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from pydantic import Field, model_validator

from cluster.base import Strict
from cluster.policy.request_budget import RequestBudget
from cluster.wire.errors import Action, ClusterError, NoCapacity, RateLimited

# --------------------------------------------------------------------------------------------
# Classifying errors
# --------------------------------------------------------------------------------------------


def classify(exc: BaseException) -> Action:
    """What the router should do about ``exc`` raised by an attempt before its first token.

    A :class:`ClusterError` says so itself. Connection errors, timeouts and other ``OSError`` s are
    the upstream's trouble: retry elsewhere. An exception we do not know also retries elsewhere: from
    a replica it usually means the replica died (Ray's actor errors are not importable here), and a
    deterministic bug is still bounded by the candidate list, the breakers and the retry budget.
    Anything that is not an ``Exception`` (cancellation, interpreter exit) is never retried.
    """
    if isinstance(exc, ClusterError):
        return exc.action
    if not isinstance(exc, Exception):
        return Action.FATAL
    # TimeoutError covers asyncio.TimeoutError (an alias since 3.11); ConnectionError is an OSError.
    return Action.RETRY_ELSEWHERE


def counts_against_backend(exc: BaseException) -> bool:
    """Whether ``exc`` is evidence that the backend is unhealthy (a breaker failure).

    Client errors are the request's fault. A 429 is a quota signal with its own ``Retry-After``,
    handled by admission's budgets, not a health signal; every other failure counts (5xx, timeouts,
    connect errors, a refused provider key: all requests would fail there alike).
    """
    if not isinstance(exc, Exception):
        return False
    return classify(exc) is not Action.CLIENT and not isinstance(exc, RateLimited | NoCapacity)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


class BreakerConfig(Strict):
    consecutive_failures: int = Field(5, gt=0, description="Failures in a row that open a breaker.")
    failure_rate: float = Field(0.5, gt=0, le=1, description="Failure share over the window that opens it.")
    min_requests: int = Field(20, gt=0, description="Requests in the window before the rate is trusted.")
    window_s: float = Field(30.0, gt=0, description="Sliding window for the failure rate.")
    window_buckets: int = Field(10, gt=0, description="Slots of the window (its edge is this coarse).")
    base_ejection_s: float = Field(5.0, gt=0, description="How long the first ejection lasts.")
    ejection_multiplier: float = Field(2.0, ge=1, description="Growth of the ejection time per repeat.")
    max_ejection_s: float = Field(300.0, gt=0, description="Longest ejection.")
    ejection_decay_s: float = Field(
        60.0, gt=0, description="Each such period spent closed forgets one past ejection (for the growth)."
    )
    half_open_probes: int = Field(1, gt=0, description="Requests let through at once while half-open.")
    half_open_successes: int = Field(1, gt=0, description="Probe successes that close the breaker.")
    probe_timeout_s: float = Field(60.0, gt=0, description="A probe with no verdict by then frees its slot.")
    max_ejection_percent: float = Field(
        50.0, ge=0, le=100, description="Most replicas of one backend ejected at once (open or half-open)."
    )

    @model_validator(mode="after")
    def _ejection_bounds(self) -> BreakerConfig:
        if self.base_ejection_s > self.max_ejection_s:
            raise ValueError("base_ejection_s must not exceed max_ejection_s")
        return self


class RetryBudgetConfig(Strict):
    ratio: float = Field(0.2, ge=0, description="Retries allowed per request over the window.")
    min_per_s: float = Field(1.0, ge=0, description="Retries per second allowed regardless of traffic.")
    window_s: float = Field(10.0, gt=0, description="Window over which requests and retries are counted.")
    window_buckets: int = Field(10, gt=0, description="Slots of the window.")


class FailoverConfig(Strict):
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="Circuit breakers.")
    retry_budget: RetryBudgetConfig = Field(default_factory=RetryBudgetConfig, description="Retry budget.")
    min_attempt_s: float = Field(0.5, ge=0, description="No attempt starts with less time left than this.")
    max_attempts: int | None = Field(None, gt=0, description="Attempts per request (None: all).")
    try_open_when_all_open: bool = Field(
        True, description="When every untried candidate is open, try the longest-open one instead of failing."
    )


# --------------------------------------------------------------------------------------------
# A sliding window of two counters, bounded memory
# --------------------------------------------------------------------------------------------


class WindowCounts:
    """Two counters (``a``, ``b``) over the last ``window_s``, kept in ``buckets`` time slots.

    The window covers the current slot and the ``buckets - 1`` before it, so its far edge is
    accurate to ``window_s / buckets``: the price of constant memory at any request rate.
    """

    def __init__(self, window_s: float, buckets: int = 10) -> None:
        self.width = window_s / buckets
        self._slots = [[-1, 0, 0] for _ in range(buckets)]  # [slot index, a, b]

    def add(self, now: float, a: int = 0, b: int = 0) -> None:
        idx = math.floor(now / self.width)
        slot = self._slots[idx % len(self._slots)]
        if slot[0] != idx:
            slot[:] = [idx, 0, 0]
        slot[1] += a
        slot[2] += b

    def totals(self, now: float) -> tuple[int, int]:
        idx = math.floor(now / self.width)
        oldest = idx - len(self._slots) + 1
        a = b = 0
        for i, sa, sb in self._slots:
            if oldest <= i <= idx:
                a += sa
                b += sb
        return a, b

    def clear(self) -> None:
        for slot in self._slots:
            slot[:] = [-1, 0, 0]


# --------------------------------------------------------------------------------------------
# Circuit breaker
# --------------------------------------------------------------------------------------------


class BreakerState(IntEnum):
    """Exported as a gauge: 0 closed, 1 open, 2 half-open."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """One breaker (a backend's or a replica's). Results of attempts go in; ``allow`` says whether
    a new attempt may go out. Results that arrive while open (attempts started before it opened)
    are ignored: they neither extend nor shorten the ejection."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._state = BreakerState.CLOSED
        self._window = WindowCounts(self.config.window_s, self.config.window_buckets)
        self.consecutive_failures = 0
        self.ejections = 0  # recent ejections, drives the growth of the ejection time
        self.ejections_total = 0
        self.opened_at: float | None = None
        self.open_until: float | None = None
        self._closed_since: float | None = None
        self._probes: deque[float] = deque()  # start times of probes in flight
        self._probe_successes = 0

    # State ---------------------------------------------------------------------------------
    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and self.open_until is not None and now >= self.open_until:
            self._state = BreakerState.HALF_OPEN
            self._probes.clear()
            self._probe_successes = 0
        return self._state

    def available(self, now: float) -> bool:
        """Whether ``allow`` would admit an attempt now (takes nothing)."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        self._expire_probes(now)
        return len(self._probes) < self.config.half_open_probes

    def allow(self, now: float) -> bool:
        """Admit an attempt: always when closed, never when open, one probe slot when half-open.
        An admitted probe must end in ``record_success``, ``record_failure`` or ``release``."""
        if not self.available(now):
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probes.append(now)
        return True

    def release(self, now: float) -> None:
        """An admitted attempt ended without a verdict (cancelled, lost a hedge race)."""
        if self.state(now) is BreakerState.HALF_OPEN and self._probes:
            self._probes.popleft()

    # Results -------------------------------------------------------------------------------
    def record_success(self, now: float) -> None:
        state = self.state(now)
        if state is BreakerState.CLOSED:
            self.consecutive_failures = 0
            self._window.add(now, a=1)
        elif state is BreakerState.HALF_OPEN:
            if self._probes:
                self._probes.popleft()
            self._probe_successes += 1
            if self._probe_successes >= self.config.half_open_successes:
                self._close(now)

    def record_failure(self, now: float, can_open: bool = True) -> bool:
        """Count a failure; returns True when it opened the breaker. ``can_open=False`` (the
        ejection cap is reached) keeps it closed, still counting, so a later failure re-checks."""
        state = self.state(now)
        if state is BreakerState.OPEN:
            return False
        if state is BreakerState.HALF_OPEN:
            self._open(now)  # already counted as ejected: the cap does not apply
            return True
        self.consecutive_failures += 1
        self._window.add(now, b=1)
        if can_open and self._should_open(now):
            self._forget_old_ejections(now)
            self._open(now)
            return True
        return False

    def ejection_time(self, ejections: int) -> float:
        """How long the ``ejections``-th recent ejection lasts (1-based)."""
        c = self.config
        exponent = max(0, ejections - 1)
        if c.ejection_multiplier == 1 or exponent == 0:
            return min(c.base_ejection_s, c.max_ejection_s)
        # Past this exponent the cap holds; checking first keeps mult ** exponent from overflowing.
        if exponent >= math.log(c.max_ejection_s / c.base_ejection_s) / math.log(c.ejection_multiplier):
            return c.max_ejection_s
        return min(c.base_ejection_s * c.ejection_multiplier**exponent, c.max_ejection_s)

    # Internals -----------------------------------------------------------------------------
    def _should_open(self, now: float) -> bool:
        if self.consecutive_failures >= self.config.consecutive_failures:
            return True
        ok, failed = self._window.totals(now)
        total = ok + failed
        return total >= self.config.min_requests and failed >= self.config.failure_rate * total

    def _forget_old_ejections(self, now: float) -> None:
        if self._closed_since is not None:
            forgiven = math.floor((now - self._closed_since) / self.config.ejection_decay_s)
            self.ejections = max(0, self.ejections - forgiven)

    def _open(self, now: float) -> None:
        self.ejections += 1
        self.ejections_total += 1
        self._state = BreakerState.OPEN
        self.opened_at = now
        self.open_until = now + self.ejection_time(self.ejections)
        self._probes.clear()
        self._probe_successes = 0

    def _close(self, now: float) -> None:
        self._state = BreakerState.CLOSED
        self._closed_since = now
        self.consecutive_failures = 0
        self._window.clear()  # the failures that opened it must not re-open it at once
        self._probes.clear()

    def _expire_probes(self, now: float) -> None:
        while self._probes and now - self._probes[0] >= self.config.probe_timeout_s:
            self._probes.popleft()


class ReplicaEjector:
    """The breakers of one backend's replicas, with a cap on how many are ejected at once.

    Ejected means open or half-open (a half-open replica gets only probes, so it is not capacity).
    The cap is ``floor(n * max_ejection_percent / 100)`` replicas, at least one when the backend has
    two or more (unless the percentage is 0). A single-replica backend is never ejected here: its
    backend breaker decides.
    """

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.breakers: dict[str, CircuitBreaker] = {}

    def sync(self, replicas: Iterable[str]) -> None:
        """Set the current replicas: new ones start closed, gone ones are forgotten."""
        wanted = list(replicas)
        self.breakers = {r: self.breakers.get(r) or CircuitBreaker(self.config) for r in wanted}

    def breaker(self, replica: str) -> CircuitBreaker:
        if replica not in self.breakers:
            self.breakers[replica] = CircuitBreaker(self.config)
        return self.breakers[replica]

    def max_ejected(self) -> int:
        n = len(self.breakers)
        if n < 2 or self.config.max_ejection_percent == 0:
            return 0
        return max(1, math.floor(n * self.config.max_ejection_percent / 100 + 1e-9))

    def ejected(self, now: float) -> list[str]:
        return [r for r, b in self.breakers.items() if b.state(now) is not BreakerState.CLOSED]

    def record_success(self, replica: str, now: float) -> None:
        self.breaker(replica).record_success(now)

    def record_failure(self, replica: str, now: float) -> bool:
        b = self.breaker(replica)
        can_open = b.state(now) is not BreakerState.CLOSED or len(self.ejected(now)) < self.max_ejected()
        return b.record_failure(now, can_open=can_open)

    def routable(self, now: float) -> list[str]:
        """Replicas an attempt may go to (closed, or half-open with a free probe slot), in order.
        The router's :meth:`BreakerBoard.admit` takes a probe slot on the one picked."""
        return [r for r, b in self.breakers.items() if b.available(now)]

    def states(self, now: float) -> dict[str, BreakerState]:
        return {r: b.state(now) for r, b in self.breakers.items()}


class BreakerBoard:
    """Every breaker of a router: one per backend and one :class:`ReplicaEjector` per backend."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._backends: dict[str, CircuitBreaker] = {}
        self._replicas: dict[str, ReplicaEjector] = {}

    def backend(self, name: str) -> CircuitBreaker:
        if name not in self._backends:
            self._backends[name] = CircuitBreaker(self.config)
        return self._backends[name]

    def backends(self, names: Iterable[str]) -> dict[str, CircuitBreaker]:
        """The backend breakers of ``names``, as :meth:`FailoverPlan.next` takes them."""
        return {n: self.backend(n) for n in names}

    def replicas(self, backend: str) -> ReplicaEjector:
        if backend not in self._replicas:
            self._replicas[backend] = ReplicaEjector(self.config)
        return self._replicas[backend]

    def admit(self, backend: str, replica: str, now: float) -> None:
        """An attempt went to ``replica``: the board alone takes its breaker's half-open probe slot."""
        if (breaker := self.replicas(backend).breakers.get(replica)) is not None:
            breaker.allow(now)

    def record(self, backend: str, replica: str | None, ok: bool, now: float) -> None:
        """Record one attempt's verdict on the backend breaker and, if known, the replica's."""
        if ok:
            self.backend(backend).record_success(now)
            if replica is not None:
                self.replicas(backend).record_success(replica, now)
        else:
            self.backend(backend).record_failure(now)
            if replica is not None:
                self.replicas(backend).record_failure(replica, now)

    def metrics(self, now: float) -> list[tuple[str, str, int]]:
        """``(backend, replica or "", state 0/1/2)`` for a gauge."""
        rows = [(name, "", int(b.state(now))) for name, b in self._backends.items()]
        for name, ej in self._replicas.items():
            rows.extend((name, r, int(s)) for r, s in ej.states(now).items())
        return rows


# --------------------------------------------------------------------------------------------
# Retry budget
# --------------------------------------------------------------------------------------------


class RatioBudgetConfig(Protocol):
    """What a ratio budget reads of its config (the retry budget's, the migration policy's)."""

    @property
    def ratio(self) -> float: ...
    @property
    def min_per_s(self) -> float: ...
    @property
    def window_s(self) -> float: ...
    @property
    def window_buckets(self) -> int: ...


class RetryBudget:
    """Retries allowed over the window: ``ratio * requests + min_per_s * window_s`` minus the
    retries already made in it. Only first attempts count as requests; hedges have their own budget.
    Mid-stream migrations spend one of their own (:class:`cluster.policy.migration.MigrationPolicy`)."""

    def __init__(self, config: RatioBudgetConfig | None = None) -> None:
        self.config: RatioBudgetConfig = config or RetryBudgetConfig()
        # a: requests, b: retries
        self._counts = WindowCounts(self.config.window_s, self.config.window_buckets)

    def deposit(self, now: float) -> None:
        """One first attempt was sent (:mod:`cluster.policy.request_budget`'s shape)."""
        self._counts.add(now, a=1)

    def available(self, now: float) -> float:
        requests, retries = self._counts.totals(now)
        c = self.config
        return c.ratio * requests + c.min_per_s * c.window_s - retries

    def try_spend(self, now: float) -> bool:
        """Withdraw one retry if the budget allows it."""
        if self.available(now) < 1 - 1e-9:
            return False
        self._counts.add(now, b=1)
        return True

    def refund(self, now: float) -> None:
        """A retry withdrawn and never made goes back to the window it is in now."""
        self._counts.add(now, b=-1)


# --------------------------------------------------------------------------------------------
# The order of attempts for one request
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedAttempt:
    backend: str
    attempt: int  # 0 for the first, as GenerateRequest.attempt
    forced: bool = False  # went to an open breaker because every candidate was open


@dataclass
class FailoverPlan:
    """Hands out the candidates of one request in order, each at most once.

    A candidate whose breaker is open (or half-open with no probe slot free) is skipped. When no
    untried candidate is admitted, the one whose breaker opened longest ago is tried anyway
    (``try_open_when_all_open``): it is the likeliest to have recovered, and a request that fails
    for sure is worse than one that may not; the retry budget bounds what this costs a sick cluster.
    No attempt starts when less than ``min_attempt_s`` is left before ``deadline``. Attempts after
    the first withdraw from ``retry_budget`` (hedges do not: they have their own budget).
    ``stop_reason`` says why :meth:`next` returned None: exhausted, deadline, max_attempts, retry_budget.
    """

    candidates: Sequence[str]
    deadline: float | None = None  # on the clock `now` is on
    config: FailoverConfig = field(default_factory=FailoverConfig)
    retry_budget: RequestBudget | None = None
    tried: list[str] = field(default_factory=list)
    stop_reason: str | None = None

    def next(
        self,
        now: float,
        breakers: Mapping[str, CircuitBreaker],
        *,
        hedge: bool = False,
        skip: Callable[[str], bool] | None = None,
    ) -> PlannedAttempt | None:
        """The next attempt (its breaker's probe slot already taken), or None. Candidates with no
        breaker in ``breakers`` count as closed; ``skip``: candidates passed over this time."""
        attempt = len(self.tried)
        limit = self.config.max_attempts
        if limit is not None and attempt >= limit:
            return self._stop("max_attempts")
        if self.deadline is not None and self.deadline - now < self.config.min_attempt_s:
            return self._stop("deadline")
        untried = [
            c for c in dict.fromkeys(self.candidates) if c not in self.tried and not (skip and skip(c))
        ]
        if not untried:
            return self._stop("exhausted")
        chosen = next((c for c in untried if c not in breakers or breakers[c].available(now)), None)
        forced = chosen is None
        if chosen is None:
            if not self.config.try_open_when_all_open:
                return self._stop("exhausted")
            chosen = min(untried, key=lambda c: _opened_at(breakers[c]))
        budget = self.retry_budget
        if attempt > 0 and not hedge and budget is not None and not budget.try_spend(now):
            return self._stop("retry_budget")
        if not forced and chosen in breakers:
            breakers[chosen].allow(now)
        self.tried.append(chosen)
        return PlannedAttempt(chosen, attempt, forced)

    def _stop(self, reason: str) -> PlannedAttempt | None:
        """Ends the plan: records why; no attempt (None) for ``next`` to return."""
        self.stop_reason = reason
        return None


def _opened_at(b: CircuitBreaker) -> float:
    return b.opened_at if b.opened_at is not None else -math.inf
