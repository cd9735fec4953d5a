"""Fair queuing inside a surface when its queue is long or full (issue 16 item 4): a light tenant's
newcomer is placed by its share, not behind a heavy tenant's whole backlog, and a full queue takes it
in place of the heavy tenant's newest waiter, which gets a 429 with Retry-After at once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from cluster.config import SurfaceConfig
from cluster.policy import fair_queue
from cluster.policy.admission import AdmissionController, Queued, Rejection, Ticket
from cluster.policy.admission_async import AsyncAdmission
from cluster.wire.errors import RateLimited


@dataclass
class W:
    id: int
    tenant: str | None


ONE = {"heavy": 1.0, "light": 1.0}


def test_a_tenants_waiters_start_one_share_apart_from_its_virtual_time() -> None:
    queue = [W(1, "heavy"), W(2, "heavy"), W(3, "light"), W(4, None)]
    got, count = fair_queue.tags(queue, {"heavy": 3.0}, 1.0, {"heavy": 1.0, "light": 0.5})
    assert got == [(3.0, 1), (4.0, 2), (1.0, 3), (1.0, 4)]  # light: vclock; none: vclock
    assert count == {"heavy": 2, "light": 1, None: 1}


def test_a_light_newcomer_is_placed_by_its_share_not_behind_the_backlog() -> None:
    queue = [W(i, "heavy") for i in range(1, 9)]  # heavy's tags 0..7
    assert fair_queue.ahead_of("light", queue, {}, 0.0, ONE) == 1  # only the tie at tag 0 is older
    assert fair_queue.ahead_of("heavy", queue, {}, 0.0, ONE) == 8  # heavy's own: after all of it
    assert fair_queue.ahead_of("gold", queue, {}, 0.0, {"heavy": 1.0, "gold": 4.0}) == 1


def test_a_full_queue_gives_the_newcomer_the_place_of_the_latest_tag() -> None:
    queue = [W(1, "heavy"), W(2, "light"), W(3, "heavy"), W(4, "heavy")]  # heavy 0,1,2; light 0
    assert fair_queue.push_out("light", queue, {}, 0.0, ONE) == 4  # light's next is at 1 < 2
    assert fair_queue.push_out("heavy", queue, {}, 0.0, ONE) is None  # heavy's own next: at 3
    even = [W(1, "heavy"), W(2, "light")]
    assert fair_queue.push_out("light", even, {}, 0.0, ONE) is None  # light's next at 1, heavy's at 0
    assert fair_queue.push_out(None, queue, {}, 0.0, ONE) is None  # no tenant: no share to claim
    assert fair_queue.push_out("light", [], {}, 0.0, ONE) is None


def agent(queue: int, deadline_ms: float = 60_000) -> SurfaceConfig:
    return SurfaceConfig(
        name="agent", priority=2, max_concurrency=1, max_queue=queue, queue_deadline_ms=deadline_ms
    )


def test_a_full_queue_of_one_tenant_takes_another_in_place_of_its_newest() -> None:
    c = AdmissionController([agent(3)], tenant_weights=ONE)
    running = c.try_admit("agent", 0.0, tenant="heavy")
    heavy = [c.try_admit("agent", 0.1, tenant="heavy") for _ in range(3)]
    assert isinstance(running, Ticket) and all(isinstance(q, Queued) for q in heavy)
    over = c.try_admit("agent", 0.2, tenant="heavy")  # heavy's fourth: the queue is full
    assert isinstance(over, Rejection) and over.reason == "queue_full"
    assert c.precheck("agent", 0.2, "heavy") is not None  # so is the precheck, before parsing
    assert c.precheck("agent", 0.2) is not None  # and for a request without a tenant
    assert c.precheck("agent", 0.2, "light") is None  # light can take a place: go on
    light = c.try_admit("agent", 0.3, tenant="light")
    assert isinstance(light, Queued)
    (out,) = c.take_pushed_out()
    assert out.reason == "pushed_out" and out.entry_id == heavy[-1].id  # heavy's newest
    assert out.error.status_code == 429 and out.error.retry_after_s is not None
    assert "smaller share" in out.error.message
    assert c.take_pushed_out() == []  # each answered once
    assert c.waiting("agent") == 3
    (ticket,) = c.release(running, "completed", 1.0)
    assert ticket.id == light.id  # light's first goes before heavy's second
    k = c.counters()
    assert (k.pushed_out, k.rejected_queue_full, k.waiting) == (1, 3, 2) and k.balanced()  # 1 + 2 prechecks


def test_without_tenants_a_full_queue_refuses_the_newcomer_as_before() -> None:
    c = AdmissionController([agent(1)])
    assert isinstance(c.try_admit("agent", 0.0, tenant="heavy"), Ticket)
    assert isinstance(c.try_admit("agent", 0.1, tenant="heavy"), Queued)
    r = c.try_admit("agent", 0.2, tenant="light")
    assert isinstance(r, Rejection) and r.reason == "queue_full"
    assert c.take_pushed_out() == [] and c.counters().pushed_out == 0


def test_a_light_tenants_predicted_wait_counts_only_the_waiters_before_it() -> None:
    # 1 s requests, one at a time, a 10 s deadline (refused at once past 8 s predicted)
    c = AdmissionController([agent(100, 10_000)], tenant_weights=ONE)
    now = 0.0
    for _ in range(4):  # the predictor's durations: 1 s each
        t = c.try_admit("agent", now, tenant="light")
        assert isinstance(t, Ticket)
        now += 1.0
        assert c.release(t, "completed", now) == []
    running = c.try_admit("agent", now, tenant="heavy")
    assert isinstance(running, Ticket)
    heavy = [c.try_admit("agent", now, tenant="heavy") for _ in range(8)]
    assert all(isinstance(q, Queued) for q in heavy)
    late = c.try_admit("agent", now, tenant="heavy")  # behind 8 + the one running: ~9 s
    assert isinstance(late, Rejection) and late.reason == "predicted_wait"
    assert c.precheck("agent", now, "heavy") is not None
    assert c.precheck("agent", now, "light") is None  # light goes first: ~1 s
    assert isinstance(c.try_admit("agent", now, tenant="light"), Queued)
    assert c.counters().balanced()


class Clock:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> float:
        return self.loop.time()


async def test_a_pushed_out_waiter_is_answered_at_once() -> None:
    adm = AsyncAdmission(AdmissionController([agent(1)], tenant_weights=ONE), Clock())
    held = await adm.acquire("agent", tenant="heavy")
    waiter = asyncio.create_task(adm.acquire("agent", tenant="heavy"))
    await asyncio.sleep(0)
    assert adm.pending() == 1
    light = asyncio.create_task(adm.acquire("agent", tenant="light"))
    with pytest.raises(RateLimited, match="smaller share"):
        await asyncio.wait_for(waiter, 1)  # answered when light arrived, not at its deadline
    assert adm.pending() == 1
    adm.release(held, "completed")
    got = await asyncio.wait_for(light, 1)
    adm.release(got, "completed")
    k = adm.controller.counters()
    assert (k.pushed_out, k.waiting, k.in_flight) == (1, 0, 0) and k.balanced()
