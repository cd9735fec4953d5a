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

After the first chunk the winner's stream is passed through; if it then fails, the stream ends with
:class:`StreamInterrupted` (a clean terminal error for the client, never a silent truncation).

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

from cluster.errors import Action, BackendUnavailable, ClusterError, StreamInterrupted, UpstreamTimeout
from cluster.failover import PlannedAttempt
from cluster.protocol import Chunk

Verdict = Literal["won", "failed", "cancelled", "broken"]  # broken: failed after its first token


@dataclass
class Attempt:
    planned: PlannedAttempt
    hedge: bool
    stream: Any  # an async iterator of Chunk (a Serve response generator in production)
    started_at: float
    task: asyncio.Task[Chunk] | None = None


@dataclass
class RaceHooks:
    """What the race needs from its caller."""

    next_attempt: Callable[[bool], PlannedAttempt | None]  # hedge? -> the next candidate, or None
    start: Callable[[PlannedAttempt, bool, list[Attempt]], Any]  # -> an async iterator of Chunk
    cancel: Callable[[Any], Awaitable[None]]  # stop an attempt's stream (aborts it upstream)
    hedge_delay: Callable[[PlannedAttempt], float | None] = lambda _: None  # None: no hedging
    may_hedge: Callable[[float, int], bool] = lambda _elapsed, _sent: False  # spends the hedge budget
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


async def race(
    hooks: RaceHooks, result: RaceResult, deadline: float | None = None, idle_timeout: float | None = None
) -> AsyncIterator[Chunk]:
    """Yield the winning attempt's chunks; raise the last error if no attempt produced one. After
    the first chunk, ``idle_timeout`` seconds of silence or the deadline end the stream with an
    error (an ``UpstreamTimeout`` wrapped as ``StreamInterrupted``)."""
    clock = hooks.clock
    t0 = clock()
    wrap = hooks.wrap_error or _as_cluster_error
    active: dict[asyncio.Task[Chunk], Attempt] = {}

    def launch(planned: PlannedAttempt, hedge: bool) -> None:
        stream = hooks.start(planned, hedge, result.attempts)
        att = Attempt(planned, hedge, stream, clock())
        att.task = asyncio.ensure_future(stream.__anext__())
        active[att.task] = att
        result.attempts.append(att)

    async def stop(att: Attempt) -> None:
        if att.task is not None and not att.task.done():
            att.task.cancel()
            with contextlib.suppress(BaseException):
                await att.task
        with contextlib.suppress(Exception):
            await hooks.cancel(att.stream)

    first = hooks.next_attempt(False)
    if first is None:
        raise BackendUnavailable("no backend is available for this request")
    launch(first, False)
    hedging_open = True
    winner: Attempt | None = None
    first_chunk: Chunk | None = None
    try:
        while winner is None:
            if not active:
                nxt = hooks.next_attempt(False)
                if nxt is None:
                    raise result.errors[-1] if result.errors else BackendUnavailable("no attempt succeeded")
                launch(nxt, False)
                continue
            timeout: float | None = None
            if hedging_open:
                delay = hooks.hedge_delay(first)
                if delay is None:
                    hedging_open = False
                else:
                    timeout = max(0.0, t0 + delay * (result.hedges + 1) - clock())
            if deadline is not None:
                left = max(0.0, deadline - clock())
                timeout = left if timeout is None else min(timeout, left)
            done, _ = await asyncio.wait(active, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if deadline is not None and clock() >= deadline:
                    raise UpstreamTimeout("no token before the request's deadline")
                if hooks.may_hedge(clock() - t0, result.hedges):
                    nxt = hooks.next_attempt(True)
                    if nxt is not None:
                        result.hedges += 1
                        launch(nxt, True)
                        continue
                hedging_open = False
                continue
            for task in done:
                att = active.pop(task)
                exc = task.exception()
                if exc is None and winner is None:
                    winner, first_chunk = att, task.result()
                    continue
                if exc is None:  # a second attempt produced a token in the same instant: it loses
                    active[task] = att
                    continue
                err = wrap(exc, att.planned)
                result.errors.append(err)
                hooks.verdict(att, "failed", err, clock() - att.started_at)
                if err.action != Action.RETRY_ELSEWHERE:
                    raise err
        # The winner: cancel the others (the loser's cancel reaches its engine or provider).
        result.winner = winner
        hooks.verdict(winner, "won", None, clock() - winner.started_at)
        for task, att in list(active.items()):
            active.pop(task)
            hooks.verdict(att, "cancelled", None, clock() - att.started_at)
            await stop(att)
    finally:
        for att in list(active.values()):  # an error or the caller's cancellation: stop them all
            hooks.verdict(att, "cancelled", None, clock() - att.started_at)
            await stop(att)
        if winner is None:
            for att in result.attempts:
                with contextlib.suppress(Exception):
                    await hooks.cancel(att.stream)
    assert first_chunk is not None
    yield first_chunk
    try:
        while True:
            # After the first token, a backend that goes silent must not hold the client: the
            # stream ends with an error after `idle_timeout` of silence or at the deadline.
            wait = idle_timeout
            if deadline is not None:
                left = max(0.0, deadline - clock())
                wait = left if wait is None else min(wait, left)
            try:
                chunk = await asyncio.wait_for(winner.stream.__anext__(), wait)
            except StopAsyncIteration:
                break
            except TimeoutError as exc:
                raise UpstreamTimeout(
                    f"backend {winner.planned.backend} went silent mid-stream ({wait:.1f} s without a token)"
                ) from exc
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:
        err = wrap(exc, winner.planned)
        hooks.verdict(winner, "broken", err, clock() - winner.started_at)
        if isinstance(err, StreamInterrupted):
            raise err from exc
        raise StreamInterrupted(
            f"the stream broke after it started: {err.message}", backend=err.backend
        ) from exc
    finally:
        await hooks.cancel(winner.stream)
