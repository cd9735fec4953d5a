"""Admission: limits, priority queues with deadlines, backend caps, exactly-once accounting."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import SurfaceConfig, parse_config
from cluster.policy.admission import AdmissionController, Counters, Outcome, Queued, Rejection, Ticket
from cluster.policy.admission_async import AsyncAdmission
from cluster.wire.errors import Overloaded, RateLimited


def surf(name: str, priority: int, conc: int, queue: int, deadline_ms: float) -> SurfaceConfig:
    return SurfaceConfig(
        name=name, priority=priority, max_concurrency=conc, max_queue=queue, queue_deadline_ms=deadline_ms
    )


TAB = surf("tab", 0, 2, 2, 1000)
CHAT = surf("chat", 1, 2, 2, 2000)
AGENT = surf("agent", 2, 1, 3, 5000)


def ctl(*surfaces: SurfaceConfig, caps=None, **kw) -> AdmissionController:
    return AdmissionController(surfaces or (TAB, CHAT, AGENT), caps, **kw)


# Limits, queues, rejections ---------------------------------------------------------------------


def test_admit_up_to_the_limit_then_queue_then_reject():
    c = ctl()
    t1, t2 = c.try_admit("tab", 0.0), c.try_admit("tab", 0.0)
    assert isinstance(t1, Ticket) and isinstance(t2, Ticket)
    assert (t1.id, t2.id, t1.backend, t1.waited_s) == (1, 2, None, 0.0)
    q1, q2 = c.try_admit("tab", 0.1), c.try_admit("tab", 0.2)
    assert q1 == Queued(3, "tab", 0.1, 1.1, 0)
    assert q2 == Queued(4, "tab", 0.2, 1.2, 1)
    r = c.try_admit("tab", 0.3)
    assert isinstance(r, Rejection) and r.reason == "queue_full" and r.entry_id is None
    assert isinstance(r.error, RateLimited) and r.error.status_code == 429
    assert r.error.retry_after_s == 1.0  # nothing completed yet: the surface's queue deadline
    assert r.error.headers() == {"retry-after": "1"}
    k = c.counters("tab")
    assert (k.admitted, k.queued, k.rejected_queue_full, k.in_flight, k.waiting) == (2, 2, 1, 2, 2)
    assert c.in_flight() == 2 and c.waiting("tab") == 2 and c.in_flight("chat") == 0


def test_release_admits_waiters_in_fifo_order():
    c = ctl()
    t1, t2 = c.try_admit("tab", 0.0), c.try_admit("tab", 0.0)
    c.try_admit("tab", 0.1)
    c.try_admit("tab", 0.2)
    got = c.release(t1, Outcome.COMPLETED, 0.5)
    assert got == [Ticket(3, "tab", None, 0.1, 0.5)]
    assert got[0].waited_s == pytest.approx(0.4)
    assert c.release(t2, "errored", 0.6) == [Ticket(4, "tab", None, 0.2, 0.6)]
    assert c.release(got[0], Outcome.CANCELLED, 0.7) == []
    k = c.counters("tab")
    assert (k.admitted, k.admitted_after_wait, k.completed, k.errored, k.cancelled, k.in_flight) == (
        4,
        2,
        1,
        1,
        1,
        1,
    )
    assert k.balanced()


def test_priority_decides_who_gets_a_shared_backend_slot():
    c = ctl(caps={"b": 2})
    chat1 = c.try_admit("chat", 0.0, ["b"])
    chat2 = c.try_admit("chat", 0.0, ["b"])
    assert isinstance(chat1, Ticket) and chat1.backend == "b" and isinstance(chat2, Ticket)
    # the backend is full: everyone else waits, whatever their surface's own room
    order = [c.try_admit(s, 0.1 * i, ["b"]) for i, s in enumerate(["agent", "chat", "tab", "agent"], 1)]
    assert all(isinstance(q, Queued) for q in order)
    agent1, chat3, tab1, agent2 = (q.id for q in order)
    # tab (priority 0) first though it came after agent and chat
    assert [t.id for t in c.release(chat1, "completed", 1.0)] == [tab1]
    # chat is at 1 of 2 now: chat (priority 1) before agent (2)
    assert [t.id for t in c.release(chat2, "completed", 1.1)] == [chat3]
    held = {t.id: t for t in c._active.values()}
    # agent's first waiter, then its second waits for agent's own limit of 1
    assert [t.id for t in c.release(held[tab1], "completed", 1.2)] == [agent1]
    assert c.release(held[chat3], "completed", 1.3) == []
    assert c.waiting("agent") == 1 and c.in_flight(backend="b") == 1
    assert [t.id for t in c.release(c._active[agent1], "completed", 1.4)] == [agent2]
    assert c.counters().balanced()


def test_same_priority_surfaces_are_served_oldest_first():
    a, b = surf("a", 1, 5, 5, 1000), surf("b", 1, 5, 5, 1000)
    c = ctl(a, b, caps={"x": 1})
    first = c.try_admit("a", 0.0, ["x"])
    qb = c.try_admit("b", 0.1, ["x"])
    qa = c.try_admit("a", 0.2, ["x"])
    assert [t.id for t in c.release(first, "completed", 0.3)] == [qb.id]
    assert [t.id for t in c.release(c._active[qb.id], "completed", 0.4)] == [qa.id]


def test_waiters_past_their_deadline_are_rejected_never_admitted():
    c = ctl()
    t1 = c.try_admit("tab", 0.0)
    c.try_admit("tab", 0.0)
    q = c.try_admit("tab", 0.5)
    assert c.next_deadline() == 1.5
    assert c.expire(1.4999) == []
    # a release after the deadline skips it (expire() will reject it)
    assert c.release(t1, "completed", 1.6) == []
    [rej] = c.expire(1.6)
    assert (rej.reason, rej.entry_id, rej.surface) == ("deadline", q.id, "tab")
    assert isinstance(rej.error, RateLimited) and "deadline" in rej.error.message
    assert c.next_deadline() is None and c.expire(99) == []
    k = c.counters("tab")
    assert (k.queued, k.rejected_deadline, k.waiting, k.in_flight) == (1, 1, 0, 1)
    assert k.balanced()


def test_next_deadline_is_the_earliest_over_surfaces():
    c = ctl(surf("a", 0, 1, 5, 5000), surf("b", 1, 1, 5, 1000))
    c.try_admit("a", 0.0)
    c.try_admit("b", 0.0)
    c.try_admit("a", 1.0)  # deadline 6.0
    c.try_admit("b", 2.0)  # deadline 3.0
    assert c.next_deadline() == 3.0
    assert [r.surface for r in c.expire(6.0)] == ["a", "b"]


def test_retry_after_comes_from_the_recent_completion_rate():
    c = ctl(surf("s", 0, 5, 2, 4000), rate_window_s=10.0)
    tickets = [c.try_admit("s", 0.0) for _ in range(5)]
    for i, t in enumerate(tickets):
        c.release(t, "completed", 1.0 + i)  # durations of 1 to 5 s: 3 s on average
    for _ in range(5):
        c.try_admit("s", 6.0)  # five in flight, just admitted: each slot frees in 3 s
    c.try_admit("s", 6.0)
    c.try_admit("s", 6.0)  # two waiting (3 s each: inside the 4 s deadline)
    r = c.try_admit("s", 6.0)
    assert r.reason == "queue_full" and r.error.retry_after_s == pytest.approx(3.0)
    # completions age out of the window; with none left, back to the queue deadline
    c2 = ctl(surf("s", 0, 1, 0, 4000), rate_window_s=10.0)
    c2.release(c2.try_admit("s", 0.0), "completed", 1.0)
    c2.try_admit("s", 2.0)
    assert c2.try_admit("s", 2.0).error.retry_after_s == pytest.approx(1 / 0.1)
    assert c2.try_admit("s", 11.0).error.retry_after_s == 4.0
    # and it is capped
    c3 = ctl(surf("s", 0, 1, 0, 4000), rate_window_s=1000.0, max_retry_after_s=60.0)
    c3.release(c3.try_admit("s", 0.0), "completed", 1.0)
    c3.try_admit("s", 2.0)
    assert c3.try_admit("s", 2.0).error.retry_after_s == 60.0


def test_overloaded_only_when_every_surface_is_blocked_with_a_full_queue():
    a, b = surf("a", 0, 1, 1, 1000), surf("b", 1, 1, 0, 1000)
    c = ctl(a, b)
    c.try_admit("a", 0.0)
    c.try_admit("a", 0.0)  # a: at its limit, queue full
    r = c.try_admit("a", 0.0)
    assert isinstance(r.error, RateLimited)  # b can still take work
    c.try_admit("b", 0.0)  # b: at its limit, no queue at all
    r = c.try_admit("a", 0.0)
    assert isinstance(r.error, Overloaded) and r.error.status_code == 503
    assert r.error.retry_after_s == 1.0
    assert c.saturated()
    assert isinstance(c.try_admit("b", 0.0).error, Overloaded)
    assert c.counters().rejected_overloaded == 2 and c.counters().rejected_queue_full == 3


def test_overloaded_when_every_backend_is_full():
    a, b = surf("a", 0, 10, 1, 1000), surf("b", 1, 10, 1, 1000)
    c = ctl(a, b, caps={"x": 1, "y": 1})
    c.try_admit("a", 0.0, ["x"])
    c.try_admit("a", 0.0, ["x", "y"])
    c.try_admit("a", 0.0, ["y"])  # queued: both backends full
    assert isinstance(c.try_admit("a", 0.0, ["x"]).error, RateLimited)
    c.try_admit("b", 0.0, ["x"])
    assert c.saturated()
    assert isinstance(c.try_admit("b", 0.0, ["y"]).error, Overloaded)


def test_zero_queue_rejects_at_once():
    c = ctl(surf("s", 0, 1, 0, 1000), surf("t", 1, 1, 5, 1000))
    c.try_admit("s", 0.0)
    r = c.try_admit("s", 0.0)
    assert r.reason == "queue_full" and isinstance(r.error, RateLimited)


def test_unknown_surface_is_a_caller_error():
    with pytest.raises(ValueError, match="unknown surface 'nope'"):
        ctl().try_admit("nope", 0.0)
    with pytest.raises(ValueError):
        AdmissionController([], None)
    with pytest.raises(ValueError):
        ctl(router_replicas=0)


# Backend caps ------------------------------------------------------------------------------------


def test_backend_caps_pick_the_first_candidate_with_room():
    c = ctl(surf("s", 0, 10, 10, 1000), caps={"x": 1, "y": 2, "p": None})
    assert c.try_admit("s", 0, ["x", "y"]).backend == "x"
    assert c.try_admit("s", 0, ["x", "y"]).backend == "y"
    assert c.try_admit("s", 0, ["x", "y"]).backend == "y"
    assert isinstance(c.try_admit("s", 0, ["x", "y"]), Queued)
    assert c.try_admit("s", 0, ["x", "p"]).backend == "p"  # None: uncapped
    assert c.try_admit("s", 0, ["unknown"]).backend == "unknown"  # not configured: uncapped
    assert c.try_admit("s", 0).backend is None  # no candidates: only the surface limit
    assert (c.in_flight(backend="x"), c.in_flight(backend="y"), c.in_flight(backend="p")) == (1, 2, 0)


def test_transfer_moves_the_backend_slot_and_fills_the_old_one():
    c = ctl(surf("s", 0, 10, 10, 1000), caps={"x": 1, "y": 1})
    t = c.try_admit("s", 0, ["x"])
    q = c.try_admit("s", 0, ["x"])
    moved, admitted = c.transfer(t, "y", 0.1)
    assert moved == Ticket(t.id, "s", "y", 0.0, 0.0)
    assert [a.id for a in admitted] == [q.id] and admitted[0].backend == "x"
    assert c.transfer(moved, "x", 0.2) == (None, [])  # x is full again
    assert c.transfer(Ticket(999, "s", "x", 0, 0), "y", 0.2) == (None, [])
    assert c.release(t, "completed", 0.3) == []  # an old copy of the ticket releases the moved slot
    assert (c.in_flight(backend="x"), c.in_flight(backend="y")) == (1, 0)


def test_set_backend_cap_admits_waiters_when_replicas_are_added():
    c = ctl(surf("s", 0, 10, 10, 1000), caps={"x": 1})
    c.try_admit("s", 0, ["x"])
    q = c.try_admit("s", 0, ["x"])
    assert [t.id for t in c.set_backend_cap("x", 2, 0.1)] == [q.id]
    assert c.set_backend_cap("x", None, 0.2) == []
    assert c.try_admit("s", 0.3, ["x"]).backend == "x"


def test_limits_are_divided_between_router_replicas():
    c = AdmissionController([surf("s", 0, 64, 256, 1000)], {"x": 10}, router_replicas=3)
    assert c.limits("s") == (22, 86)  # ceil(64 / 3), ceil(256 / 3)
    for _ in range(4):
        c.try_admit("s", 0, ["x"])
    assert isinstance(c.try_admit("s", 0, ["x"]), Queued)  # ceil(10 / 3) = 4


def test_from_config_derives_backend_caps():
    cfg = parse_config(
        {
            "models": [{"name": "m", "tokenizer": "estimate:4", "context_window": 4096}],
            "backends": [
                {"name": "v", "kind": "vllm", "model": "m", "replicas": 2, "max_in_flight_per_replica": 8},
                {
                    "name": "auto",
                    "kind": "sim",
                    "model": "m",
                    "max_in_flight_per_replica": 4,
                    "autoscaling": {"min_replicas": 1, "max_replicas": 5},
                },
                {
                    "name": "p",
                    "kind": "provider",
                    "model": "m",
                    "provider": {"api": "openai", "base_url": "x", "max_in_flight": 5},
                },
                {
                    "name": "q",
                    "kind": "provider",
                    "model": "m",
                    "provider": {"api": "openai", "base_url": "x"},
                },
            ],
            "surfaces": [{"name": "chat", "max_concurrency": 100}],
            "server": {"gateway_replicas": 2},
        }
    )
    c = AdmissionController.from_config(cfg)
    assert c._caps == {"v": 8, "auto": 10, "p": 3}
    assert c.limits("chat") == (50, 128)


# Accounting --------------------------------------------------------------------------------------


def test_double_release_is_a_counted_no_op():
    c = ctl()
    t = c.try_admit("tab", 0.0)
    c.try_admit("tab", 0.0)
    c.try_admit("tab", 0.0)
    assert len(c.release(t, "completed", 0.5)) == 1
    assert c.release(t, "errored", 0.6) == []
    assert c.release(Ticket(12345, "nope", None, 0, 0), "completed", 0.7) == []
    k = c.counters()
    assert (k.completed, k.errored, k.double_release, k.in_flight) == (1, 0, 2, 2)
    assert k.balanced()
    with pytest.raises(ValueError):
        c.release(c._active[2], "finished", 1.3)


def test_cancelled_waiters_are_abandoned_once():
    c = ctl()
    c.try_admit("tab", 0.0)
    c.try_admit("tab", 0.0)
    q = c.try_admit("tab", 0.0)
    assert c.cancel(q, 0.1) is True
    assert c.cancel(q.id, 0.2) is False
    k = c.counters("tab")
    assert (k.abandoned, k.waiting) == (1, 0) and k.balanced()


def test_accounting_invariants_hold_under_a_random_workload():
    rng = random.Random(42)
    c = ctl(caps={"x": 3, "y": 2})
    now, active, queued = 0.0, [], []
    for _ in range(3000):
        now += rng.expovariate(20)
        op = rng.random()
        if op < 0.45:
            s = rng.choice(["tab", "chat", "agent"])
            r = c.try_admit(s, now, rng.choice([["x"], ["y"], ["x", "y"], []]))
            if isinstance(r, Ticket):
                active.append(r)
            elif isinstance(r, Queued):
                queued.append(r)
        elif op < 0.8 and active:
            t = active.pop(rng.randrange(len(active)))
            active += c.release(t, rng.choice(list(Outcome)), now)
        elif op < 0.85 and queued:
            c.cancel(queued.pop(rng.randrange(len(queued))), now)
        elif op < 0.9 and active:
            i = rng.randrange(len(active))
            moved, more = c.transfer(active[i], rng.choice(["x", "y"]), now)
            if moved is not None:
                active[i] = moved
            active += more
        elif op < 0.92 and active:
            active += c.release(active[0], "completed", now)
            assert c.release(active.pop(0), "errored", now) == []  # the second one is a no-op
        else:
            c.expire(now)
        for s in ("tab", "chat", "agent", None):
            assert c.counters(s).balanced(), s
        assert all(c.in_flight(s) <= c.limits(s)[0] for s in ("tab", "chat", "agent"))
        assert c.in_flight(backend="x") <= 3 and c.in_flight(backend="y") <= 2
    while active:
        active += c.release(active.pop(), "completed", now)
    c.expire(now + 10)
    k = c.counters()
    assert k.balanced() and k.in_flight == 0 and k.waiting == 0
    assert k.admitted == k.completed + k.errored + k.cancelled
    assert k.double_release > 10 and k.admitted > 500 and k.admitted_after_wait > 100


def test_counters_sum_over_surfaces():
    total = Counters(admitted=1, completed=1)
    total.add(Counters(admitted=2, in_flight=2))
    assert total == Counters(admitted=3, completed=1, in_flight=2) and total.balanced()
    assert not Counters(admitted=1).balanced()


# asyncio wrapper ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> float:
        return self.loop.time()


async def test_slot_outcomes_are_recorded_once():
    adm = AsyncAdmission(ctl(), Clock())
    async with adm.slot("chat") as t:
        assert t.surface == "chat"
    with pytest.raises(KeyError):
        async with adm.slot("chat"):
            raise KeyError("boom")

    async def cancelled():
        async with adm.slot("chat"):
            await asyncio.sleep(10)

    task = asyncio.create_task(cancelled())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    k = adm.controller.counters("chat")
    assert (k.completed, k.errored, k.cancelled, k.in_flight) == (1, 1, 1, 0)
    adm.close()


async def test_waiter_gets_the_slot_a_release_frees():
    adm = AsyncAdmission(ctl(surf("s", 0, 1, 5, 5000)), Clock())
    first = await adm.acquire("s")
    waiter = asyncio.create_task(adm.acquire("s"))
    await asyncio.sleep(0)
    assert adm.pending() == 1
    adm.release(first, "completed")
    second = await asyncio.wait_for(waiter, 1)
    assert second.id == 2 and adm.pending() == 0
    adm.release(second, "completed")
    assert adm._timer is None
    assert adm.controller.counters().balanced()


async def test_waiter_is_rejected_by_its_deadline_never_hangs():
    adm = AsyncAdmission(ctl(surf("s", 0, 1, 5, 30)), Clock())
    held = await adm.acquire("s")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(RateLimited) as err:
        await asyncio.wait_for(adm.acquire("s"), 1)
    assert 0.025 <= loop.time() - t0 < 0.5
    assert err.value.retry_after_s == pytest.approx(0.03)
    assert adm.pending() == 0 and adm._timer is None
    adm.release(held, "completed")
    k = adm.controller.counters()
    assert (k.rejected_deadline, k.in_flight, k.waiting) == (1, 0, 0) and k.balanced()


async def test_queue_full_raises_at_once():
    adm = AsyncAdmission(ctl(surf("s", 0, 1, 0, 1000), surf("t", 1, 1, 0, 1000)), Clock())
    held = await adm.acquire("s")
    with pytest.raises(RateLimited):
        await adm.acquire("s")
    other = await adm.acquire("t")
    with pytest.raises(Overloaded):  # now no surface can take anything
        await adm.acquire("s")
    adm.release(held, "completed")
    adm.release(other, "completed")
    assert adm.controller.counters().balanced()


async def test_cancelled_waiter_is_abandoned():
    adm = AsyncAdmission(ctl(surf("s", 0, 1, 5, 5000)), Clock())
    held = await adm.acquire("s")
    waiter = asyncio.create_task(adm.acquire("s"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.pending() == 0 and adm._timer is None
    adm.release(held, "completed")
    k = adm.controller.counters()
    assert (k.abandoned, k.admitted, k.completed, k.in_flight) == (1, 1, 1, 0) and k.balanced()


@pytest.mark.parametrize("cancel_first", [False, True])
async def test_admitted_and_cancelled_at_once_releases_the_ticket(cancel_first):
    adm = AsyncAdmission(ctl(surf("s", 0, 1, 5, 5000)), Clock())
    held = await adm.acquire("s")
    waiter = asyncio.create_task(adm.acquire("s"))
    await asyncio.sleep(0)
    if cancel_first:  # cancelled, then admitted before the task ran again
        waiter.cancel()
        adm.release(held, "completed")
    else:  # admitted, then cancelled before the task ran again
        adm.release(held, "completed")
        waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    k = adm.controller.counters()
    assert (k.admitted, k.completed, k.cancelled, k.abandoned, k.in_flight) == (2, 1, 1, 0, 0)
    assert k.balanced() and adm.pending() == 0


async def test_many_concurrent_requests_all_end():
    adm = AsyncAdmission(
        ctl(surf("tab", 0, 3, 10, 200), surf("agent", 2, 3, 10, 200), caps={"b": 4}), Clock()
    )
    outcomes: list[str] = []

    async def one(i: int) -> None:
        try:
            async with adm.slot("tab" if i % 2 else "agent", ["b"]):
                await asyncio.sleep(0.002 * (i % 5))
            outcomes.append("ok")
        except (RateLimited, Overloaded):
            outcomes.append("rejected")

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(60))), 5)
    k = adm.controller.counters()
    assert len(outcomes) == 60 and outcomes.count("ok") == k.completed
    assert k.balanced() and k.in_flight == 0 and k.waiting == 0 and k.admitted_after_wait > 0
    assert adm.pending() == 0 and adm._timer is None
