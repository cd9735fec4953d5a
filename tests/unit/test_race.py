"""The first-token race: failover before the first token, hedging, cancellation of losers, and a
clean terminal error after the first token. Fake streams on the real event loop; short sleeps."""

from __future__ import annotations

import asyncio

import pytest

from cluster.policy.failover import FailoverPlan
from cluster.policy.race import RaceHooks, RaceResult, race
from cluster.wire.errors import BackendUnavailable, InvalidRequest, StreamInterrupted, UpstreamTimeout
from cluster.wire.protocol import Chunk


class FakeStream:
    """Yields ``n`` chunks after ``delay`` s, or raises ``fail`` (before the first chunk, or after
    ``fail_after`` chunks). Records whether it was cancelled."""

    def __init__(
        self, name: str, delay: float = 0.0, n: int = 3, fail: Exception | None = None, fail_after: int = 0
    ):
        self.name, self.delay, self.n, self.fail, self.fail_after = name, delay, n, fail, fail_after
        self.cancelled = False
        self.sent = 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self.sent == 0:
            await asyncio.sleep(self.delay)
        if self.fail is not None and self.sent == self.fail_after:
            raise self.fail
        if self.sent >= self.n:
            raise StopAsyncIteration
        self.sent += 1
        return Chunk(text=f"{self.name}{self.sent}", backend=self.name)


def hooks_for(streams: dict[str, FakeStream], candidates: list[str], **kw) -> tuple[RaceHooks, list[tuple]]:
    plan = FailoverPlan(candidates)
    verdicts: list[tuple] = []

    async def cancel(s: FakeStream) -> None:
        if s.sent < s.n:
            s.cancelled = True

    h = RaceHooks(
        next_attempt=lambda hedge: plan.next(0.0, {}, hedge=hedge),
        start=lambda planned, hedge, prior: streams[planned.backend],
        cancel=cancel,
        verdict=lambda att, v, err, dt: verdicts.append((att.planned.backend, v)),
        **kw,
    )
    return h, verdicts


async def collect(h: RaceHooks, deadline: float | None = None) -> tuple[list[str], RaceResult]:
    res = RaceResult()
    out = [c.text async for c in race(h, res, deadline)]
    return out, res


async def test_first_candidate_serves_when_healthy() -> None:
    streams = {"a": FakeStream("a"), "b": FakeStream("b")}
    h, verdicts = hooks_for(streams, ["a", "b"])
    out, res = await collect(h)
    assert out == ["a1", "a2", "a3"]
    assert verdicts == [("a", "won")]
    assert len(res.attempts) == 1 and not streams["b"].sent


async def test_failover_before_first_token() -> None:
    streams = {"a": FakeStream("a", fail=BackendUnavailable("down")), "b": FakeStream("b")}
    h, verdicts = hooks_for(streams, ["a", "b"])
    out, res = await collect(h)
    assert out == ["b1", "b2", "b3"]
    assert verdicts == [("a", "failed"), ("b", "won")]
    assert [type(e) for e in res.errors] == [BackendUnavailable]


async def test_plain_exceptions_count_as_retryable() -> None:
    streams = {"a": FakeStream("a", fail=ConnectionError("refused")), "b": FakeStream("b")}
    h, _ = hooks_for(streams, ["a", "b"])
    out, _ = await collect(h)
    assert out[0] == "b1"


async def test_client_error_is_not_retried() -> None:
    streams = {"a": FakeStream("a", fail=InvalidRequest("bad")), "b": FakeStream("b")}
    h, _ = hooks_for(streams, ["a", "b"])
    with pytest.raises(InvalidRequest):
        await collect(h)
    assert streams["b"].sent == 0


async def test_all_fail_raises_the_last_error() -> None:
    streams = {
        "a": FakeStream("a", fail=BackendUnavailable("a down")),
        "b": FakeStream("b", fail=UpstreamTimeout("b slow")),
    }
    h, _ = hooks_for(streams, ["a", "b"])
    with pytest.raises(UpstreamTimeout):
        await collect(h)


async def test_hedge_wins_and_the_loser_is_cancelled() -> None:
    streams = {"a": FakeStream("a", delay=5.0), "b": FakeStream("b", delay=0.0)}
    h, verdicts = hooks_for(
        streams, ["a", "b"], hedge_delay=lambda _: 0.05, may_hedge=lambda el, sent: sent < 1
    )
    out, res = await collect(h)
    assert out == ["b1", "b2", "b3"]
    assert res.hedges == 1 and res.winner is not None and res.winner.hedge
    assert streams["a"].cancelled
    assert ("a", "cancelled") in verdicts and ("b", "won") in verdicts


async def test_no_hedge_without_budget() -> None:
    streams = {"a": FakeStream("a", delay=0.15), "b": FakeStream("b")}
    h, _ = hooks_for(streams, ["a", "b"], hedge_delay=lambda _: 0.01, may_hedge=lambda el, sent: False)
    out, res = await collect(h)
    assert out[0] == "a1" and res.hedges == 0 and streams["b"].sent == 0


async def test_a_refused_hedge_is_asked_again_when_the_caller_rechecks() -> None:
    """The budget says no at the hedge delay; with ``hedge_recheck_s`` the race asks again and
    hedges once the caller says yes (a brownout seen meanwhile), where without it hedging closes."""
    asked: list[float] = []

    def may_hedge(elapsed: float, sent: int) -> bool:
        asked.append(elapsed)
        return elapsed >= 0.12  # "its backend was demoted" from 0.12 s on

    streams = {"a": FakeStream("a", delay=5.0), "b": FakeStream("b")}
    h, _ = hooks_for(
        streams, ["a", "b"], hedge_delay=lambda _: 0.02, may_hedge=may_hedge, hedge_recheck_s=0.03
    )
    out, res = await collect(h)
    assert out[0] == "b1" and res.hedges == 1 and streams["a"].cancelled
    assert len(asked) >= 3 and asked[0] < 0.12 <= asked[-1] < 0.3

    streams = {"a": FakeStream("a", delay=0.3), "b": FakeStream("b")}
    asked.clear()
    h, _ = hooks_for(streams, ["a", "b"], hedge_delay=lambda _: 0.02, may_hedge=may_hedge)
    out, res = await collect(h)
    assert out[0] == "a1" and res.hedges == 0 and len(asked) == 1  # no recheck: asked once


async def test_a_hedge_with_no_candidate_left_is_handed_back() -> None:
    streams = {"a": FakeStream("a", delay=0.08)}
    unsent: list[int] = []
    h, _ = hooks_for(
        streams,
        ["a"],  # one backend, one replica: nowhere to send a hedge
        hedge_delay=lambda _: 0.01,
        may_hedge=lambda el, sent: True,
        hedge_unsent=lambda: unsent.append(1),
    )
    out, res = await collect(h)
    assert out[0] == "a1" and res.hedges == 0 and unsent == [1]


async def test_primary_still_wins_if_it_answers_first_after_a_hedge() -> None:
    streams = {"a": FakeStream("a", delay=0.08), "b": FakeStream("b", delay=5.0)}
    h, _ = hooks_for(streams, ["a", "b"], hedge_delay=lambda _: 0.02, may_hedge=lambda el, sent: sent < 1)
    out, res = await collect(h)
    assert out[0] == "a1" and res.hedges == 1
    assert streams["b"].cancelled


async def test_mid_stream_failure_is_a_terminal_error_not_a_switch() -> None:
    streams = {"a": FakeStream("a", fail=BackendUnavailable("died"), fail_after=2), "b": FakeStream("b")}
    h, verdicts = hooks_for(streams, ["a", "b"])
    res = RaceResult()
    got = []
    with pytest.raises(StreamInterrupted):
        async for c in race(h, res):
            got.append(c.text)
    assert got == ["a1", "a2"] and streams["b"].sent == 0
    assert verdicts == [("a", "won"), ("a", "broken")]


async def test_deadline_before_first_token() -> None:
    loop = asyncio.get_running_loop()
    streams = {"a": FakeStream("a", delay=5.0)}
    h, _ = hooks_for(streams, ["a"], clock=loop.time)
    with pytest.raises(UpstreamTimeout):
        await collect(h, deadline=loop.time() + 0.05)
    assert streams["a"].cancelled


async def test_caller_cancellation_stops_every_attempt() -> None:
    streams = {"a": FakeStream("a", delay=5.0), "b": FakeStream("b", delay=5.0)}
    h, _ = hooks_for(streams, ["a", "b"], hedge_delay=lambda _: 0.01, may_hedge=lambda el, sent: sent < 1)
    task = asyncio.ensure_future(collect(h))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert streams["a"].cancelled and streams["b"].cancelled


class StallingStream(FakeStream):
    async def __anext__(self) -> Chunk:
        if self.sent >= 2:
            await asyncio.sleep(30)
        return await super().__anext__()


async def test_a_stream_silent_after_its_first_tokens_ends_with_an_error() -> None:
    streams = {"a": StallingStream("a", n=10)}
    h, verdicts = hooks_for(streams, ["a"])
    got = []
    with pytest.raises(StreamInterrupted, match="silent"):
        async for c in race(h, RaceResult(), idle_timeout=0.1):
            got.append(c.text)
    assert got == ["a1", "a2"] and streams["a"].cancelled
    assert verdicts[-1] == ("a", "broken")


async def test_the_deadline_also_holds_after_the_first_token() -> None:
    loop = asyncio.get_running_loop()
    streams = {"a": StallingStream("a", n=10)}
    h, _ = hooks_for(streams, ["a"], clock=loop.time)
    t0 = loop.time()
    with pytest.raises(StreamInterrupted):
        async for _ in race(h, RaceResult(), deadline=t0 + 0.2, idle_timeout=10):
            pass
    assert loop.time() - t0 < 5


async def test_a_client_cancel_while_losers_stop_also_stops_the_winner() -> None:
    """Defect 1: stopping the losers swallowed the request's own CancelledError, so a client that
    left during that moment left the winner generating for nobody."""
    streams = {"a": FakeStream("a", delay=5.0), "b": FakeStream("b", delay=0.05, n=50)}
    plan = FailoverPlan(["a", "b"])
    closing = asyncio.Event()
    closed: list[str] = []

    async def slow_cancel(s: FakeStream) -> None:
        if s.name == "a":  # the loser's upstream takes a while to close
            closing.set()
            await asyncio.sleep(0.5)
        closed.append(s.name)

    h = RaceHooks(
        next_attempt=lambda hedge: plan.next(0.0, {}, hedge=hedge),
        start=lambda planned, hedge, prior: streams[planned.backend],
        cancel=slow_cancel,
        hedge_delay=lambda _: 0.01,
        may_hedge=lambda _e, _s: True,
    )

    async def consume() -> None:
        async for _ in race(h, RaceResult()):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(closing.wait(), 2.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "b" in closed, "the winner's stream must be closed when the client leaves"
