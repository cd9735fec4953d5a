"""Race attempts to the first token: failover before it, hedging while waiting for it, never a switch
after it.

One request, several possible attempts (backends, or other replicas of one backend). The first
attempt starts at once. Before any attempt has produced its first chunk:

* an attempt that fails with an error whose action is ``retry_elsewhere`` is replaced by the next
  candidate (the plan decides which, and whether the retry budget and deadline allow it); an error
  the client caused ends the request at once;
* if nothing has arrived after the hedge delay, a hedge is launched (when the hedge budget allows);
* the first attempt to produce a chunk wins; every other attempt is cancelled (which aborts it
  upstream: the engine request or the provider's HTTP stream).

After the first chunk the winner's stream is passed through (:func:`follow`); if it then fails, the
stream ends with :class:`StreamInterrupted` (a clean terminal error for the client, never a silent
truncation), which the gateway may instead turn into a continuation on another replica
(``deployments/gateway/migration.py``: a new race for the continuation, never a switch inside this one).
No timer and no task per chunk: one :class:`Watchdog` per stream notices silence.

Plain asyncio, no I/O of its own: the caller passes in how to start and cancel an attempt, the plan
and the policies, so the same logic serves Serve handles in production and fakes in unit tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.policy.failover import PlannedAttempt
from cluster.wire.errors import Action, BackendUnavailable, ClusterError, StreamInterrupted, UpstreamTimeout
from cluster.wire.protocol import Chunk

Verdict = Literal["won", "failed", "cancelled", "broken"]  # broken: failed after its first token


@dataclass
class Attempt:
    planned: PlannedAttempt
    hedge: bool
    stream: Any  # the gateway's: a cluster.wire.stream.AttemptStream (any async iterator in tests)
    started_at: float
    task: asyncio.Task[Chunk] | None = None


@dataclass
class RaceHooks:
    """What the race needs from its caller."""

    next_attempt: Callable[[bool], PlannedAttempt | None]  # hedge? -> the next candidate, or None
    start: Callable[[PlannedAttempt, bool, list[Attempt]], Any]  # -> the attempt's stream
    cancel: Callable[[Any], Awaitable[None]]  # stop an attempt's stream (aborts it upstream)
    hedge_delay: Callable[[PlannedAttempt], float | None] = lambda _: None  # None: no hedging
    may_hedge: Callable[[float, int], bool] = lambda _elapsed, _sent: False  # spends the hedge budget
    hedge_unsent: Callable[[], None] = lambda: None  # may_hedge said yes but no candidate was left
    # after may_hedge said no, ask again this often (None: hedging closes): the first hedge may
    # become due later without its budget (the primary's backend demoted in a brownout meanwhile)
    hedge_recheck_s: float | None = None
    verdict: Callable[[Attempt, Verdict, BaseException | None, float], None] = lambda *_: None
    wrap_error: Callable[[BaseException, PlannedAttempt], ClusterError] | None = None
    clock: Callable[[], float] = time.monotonic


@dataclass
class RaceResult:
    winner: Attempt | None = None
    attempts: list[Attempt] = field(default_factory=list)
    hedges: int = 0
    errors: list[ClusterError] = field(default_factory=list)


def _as_cluster_error(exc: BaseException, planned: PlannedAttempt) -> ClusterError:
    if isinstance(exc, ClusterError):
        return exc
    if isinstance(exc, StopAsyncIteration):
        return BackendUnavailable(
            f"backend {planned.backend} ended the stream without output", backend=planned.backend
        )
    return BackendUnavailable(
        f"backend {planned.backend} failed: {type(exc).__name__}: {exc}", backend=planned.backend
    )


class Watchdog:
    """One per stream: a stream silent for ``idle_timeout`` seconds, or running past the deadline,
    is ended by cancelling the task that reads it (``fired`` says why; the reader turns that into a
    terminal error). The reader only stamps ``last`` per item: no timer per chunk."""

    def __init__(
        self,
        idle_timeout: float | None,
        deadline: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.idle_timeout, self.deadline, self.clock = idle_timeout, deadline, clock
        self.last = clock()
        self.fired: str | None = None
        self._target = asyncio.current_task()
        # A timer, not a task: one handle per stream, re-armed only when it comes due early
        self._timer: asyncio.TimerHandle | None = None
        if idle_timeout is not None or deadline is not None:
            self._check()

    def _due(self) -> float:
        due = float("inf") if self.idle_timeout is None else self.last + self.idle_timeout
        return due if self.deadline is None else min(due, self.deadline)

    def _check(self) -> None:
        if (wait := self._due() - self.clock()) > 0:
            self._timer = asyncio.get_running_loop().call_later(wait, self._check)
            return
        self._timer = None
        idle = self.idle_timeout is not None and self.clock() - self.last >= self.idle_timeout
        self.fired = (
            f"went silent mid-stream ({self.idle_timeout:.1f} s without a token)"
            if idle
            else "ran past the request's deadline"
        )
        if self._target is not None:
            self._target.cancel()

    def owns(self, exc: asyncio.CancelledError) -> bool:
        """Whether this cancellation is the watchdog's alone (not also the caller's)."""
        return self.fired is not None and self._target is not None and self._target.uncancel() == 0

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _stop_all(hooks: RaceHooks, atts: list[Attempt]) -> None:
    """Stop attempts: cancel their pending reads, wait for them, close their streams (which aborts
    them upstream). The caller's own cancellation is never swallowed: it is raised once every
    attempt has been told to stop."""
    pending = [a.task for a in atts if a.task is not None and not a.task.done()]
    for t in pending:
        t.cancel()
    try:
        if pending:
            await asyncio.wait(pending)
    finally:
        for a in atts:
            with contextlib.suppress(Exception):
                await hooks.cancel(a.stream)


def _launch(hooks: RaceHooks, result: RaceResult, planned: PlannedAttempt, hedge: bool) -> Attempt:
    stream = hooks.start(planned, hedge, result.attempts)
    att = Attempt(planned, hedge, stream, hooks.clock())
    att.task = asyncio.ensure_future(stream.__anext__())
    result.attempts.append(att)
    return att


def _wait_timeout(
    hooks: RaceHooks,
    result: RaceResult,
    first: PlannedAttempt,
    t0: float,
    deadline: float | None,
    not_before: float = 0.0,
) -> tuple[float | None, bool]:
    """How long to wait for the next event, and whether hedging is still open (``not_before``:
    no hedge is asked for again before then)."""
    timeout: float | None = None
    hedging_open = True
    delay = hooks.hedge_delay(first)
    if delay is None:
        hedging_open = False
    else:
        timeout = max(0.0, max(t0 + delay * (result.hedges + 1), not_before) - hooks.clock())
    if deadline is not None:
        left = max(0.0, deadline - hooks.clock())
        timeout = left if timeout is None else min(timeout, left)
    return timeout, hedging_open


async def first_token(
    hooks: RaceHooks, result: RaceResult, deadline: float | None = None
) -> tuple[Attempt, Any]:
    """Run the race until one attempt produced its first item; every other attempt is stopped.
    Returns the winner and that item; raises the last error if no attempt produced one."""
    clock, wrap = hooks.clock, hooks.wrap_error or _as_cluster_error
    t0 = clock()
    first = hooks.next_attempt(False)
    if first is None:
        raise BackendUnavailable("no backend is available for this request")
    active: dict[Any, Attempt] = {}

    def launch(planned: PlannedAttempt, hedge: bool) -> None:
        att = _launch(hooks, result, planned, hedge)
        active[att.task] = att

    launch(first, False)
    hedging_open, recheck_at = True, 0.0
    try:
        while True:
            if not active:
                nxt = hooks.next_attempt(False)
                if nxt is None:
                    raise result.errors[-1] if result.errors else BackendUnavailable("no attempt succeeded")
                launch(nxt, False)
                continue
            timeout, still_open = _wait_timeout(hooks, result, first, t0, deadline, recheck_at)
            hedging_open = hedging_open and still_open
            done, _ = await asyncio.wait(
                active,
                timeout=timeout if hedging_open or deadline is not None else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                if deadline is not None and clock() >= deadline:
                    raise UpstreamTimeout("no token before the request's deadline")
                if hedging_open and hooks.may_hedge(clock() - t0, result.hedges):
                    nxt = hooks.next_attempt(True)
                    if nxt is not None:
                        result.hedges += 1
                        launch(nxt, True)
                        continue
                    hooks.hedge_unsent()  # nowhere to send it: its budget token goes back
                elif hedging_open and hooks.hedge_recheck_s is not None and result.hedges == 0:
                    recheck_at = clock() + hooks.hedge_recheck_s  # not yet: ask again then
                    continue
                hedging_open = False
                continue
            winner = _settle(hooks, result, active, done, wrap)
            if winner is not None:
                break
    except BaseException:
        losers = list(active.values())
        for att in losers:  # an error or the caller's cancellation: stop them all
            hooks.verdict(att, "cancelled", None, clock() - att.started_at)
        await _stop_all(hooks, result.attempts)
        raise
    return await _crown(hooks, result, winner, [a for a in active.values() if a is not winner[0]])


async def _crown(
    hooks: RaceHooks, result: RaceResult, winner: tuple[Attempt, Any], losers: list[Attempt]
) -> tuple[Attempt, Any]:
    """The race is won: record it, stop the losers (their cancel reaches their engine or
    provider). A client that leaves meanwhile stops the winner too."""
    att, item = winner
    result.winner = att
    hooks.verdict(att, "won", None, hooks.clock() - att.started_at)
    for a in losers:
        hooks.verdict(a, "cancelled", None, hooks.clock() - a.started_at)
    try:
        await _stop_all(hooks, losers)
    except BaseException:
        await _stop_all(hooks, [att])
        raise
    return att, item


def _settle(
    hooks: RaceHooks,
    result: RaceResult,
    active: dict[Any, Attempt],
    done: set[Any],
    wrap: Callable[[BaseException, PlannedAttempt], ClusterError],
) -> tuple[Attempt, Any] | None:
    """Look at the finished reads: the first with an item wins; failures are recorded (a client
    error is raised at once)."""
    winner: tuple[Attempt, Any] | None = None
    for task in done:
        att = active[task]
        exc = task.exception()
        if exc is None:
            if winner is None:
                winner = (att, task.result())
            continue  # a second attempt produced a token in the same instant: it loses, later
        del active[task]
        err = wrap(exc, att.planned)
        result.errors.append(err)
        hooks.verdict(att, "failed", err, hooks.clock() - att.started_at)
        if err.action != Action.RETRY_ELSEWHERE:
            raise err
    return winner


def broken(hooks: RaceHooks, winner: Attempt, exc: BaseException) -> StreamInterrupted:
    """The error that ends a stream that failed after its first token (and its verdict)."""
    wrap = hooks.wrap_error or _as_cluster_error
    err = wrap(exc, winner.planned)
    hooks.verdict(winner, "broken", err, hooks.clock() - winner.started_at)
    if isinstance(err, StreamInterrupted):
        return err
    return StreamInterrupted(f"the stream broke after it started: {err.message}", backend=err.backend)


async def follow(
    hooks: RaceHooks, winner: Attempt, deadline: float | None = None, idle_timeout: float | None = None
) -> AsyncIterator[Any]:
    """The winner's items after its first, guarded by one watchdog; a failure (or silence, or the
    deadline) ends the stream with :class:`StreamInterrupted`."""
    dog = Watchdog(idle_timeout, deadline, hooks.clock)
    try:
        async for item in winner.stream:
            dog.last = hooks.clock()
            yield item
    except asyncio.CancelledError as cancel:
        if not dog.owns(cancel):
            raise
        timeout = UpstreamTimeout(f"backend {winner.planned.backend} {dog.fired}")
        raise broken(hooks, winner, timeout) from timeout  # the cause says: a stall (or the deadline)
    except GeneratorExit:
        raise
    except Exception as exc:
        raise broken(hooks, winner, exc) from exc
    finally:
        dog.stop()
        await hooks.cancel(winner.stream)


async def race(
    hooks: RaceHooks, result: RaceResult, deadline: float | None = None, idle_timeout: float | None = None
) -> AsyncIterator[Any]:
    """Yield the winning attempt's items; raise the last error if no attempt produced one. After
    the first item, ``idle_timeout`` seconds of silence or the deadline end the stream with an
    error (an ``UpstreamTimeout`` wrapped as ``StreamInterrupted``)."""
    winner, item = await first_token(hooks, result, deadline)
    yield item
    async for item in follow(hooks, winner, deadline, idle_timeout):
        yield item
