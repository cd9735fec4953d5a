"""Fast, honest rejects: a request whose predicted queue wait exceeds its deadline gets its 429 (or
the cluster's 503) at once, with the prediction as Retry-After, instead of waiting the deadline out."""

from __future__ import annotations

import pytest

from cluster.config import SurfaceConfig
from cluster.policy.admission import AdmissionController, Queued, Rejection, Ticket
from cluster.policy.admission_async import AsyncAdmission
from cluster.policy.queue_wait import DurationWindow, predict_wait
from cluster.wire.errors import Overloaded, RateLimited


def surf(name: str, priority: int, conc: int, queue: int, deadline_ms: float) -> SurfaceConfig:
    return SurfaceConfig(
        name=name, priority=priority, max_concurrency=conc, max_queue=queue, queue_deadline_ms=deadline_ms
    )


def test_a_slot_frees_when_the_earliest_request_in_flight_is_expected_to_end() -> None:
    d = DurationWindow(window_s=30.0)
    for i, dur in enumerate((1.0, 2.0, 3.0)):
        d.add(float(i), dur)  # mean 2 s
    # Two in flight, 0.5 s and 1.5 s along. The first is expected to take the mean of the
    # durations above 0.5 s (2 s): 1.5 s more; the second the mean of those above 1.5 s (2.5 s):
    # 1 s more, not the 0.5 s the overall mean would leave it.
    assert predict_wait(0, [0.5, 1.5], d, 3.0).wait_s == pytest.approx(1.0)
    assert predict_wait(1, [0.5, 1.5], d, 3.0).wait_s == pytest.approx(1.5)
    # The third waiter takes the first slot again after the first waiter's 2 s: 1 + 2.
    est = predict_wait(2, [0.5, 1.5], d, 3.0)
    assert est is not None and est.wait_s == pytest.approx(3.0) and est.mean_duration_s == pytest.approx(2.0)
    # A request past every recent duration takes another mean (it used to count as freeing at
    # once); no estimate without samples or with nothing in flight.
    assert predict_wait(0, [9.0], d, 3.0).wait_s == pytest.approx(2.0)
    assert predict_wait(0, [2.5], d, 3.0).wait_s == pytest.approx(0.5)  # only the 3 s one was longer
    assert predict_wait(0, [], d, 3.0) is None
    assert predict_wait(0, [0.1], DurationWindow(), 3.0) is None
    assert d.mean(40.0, 1) is None  # aged out of the window


def _busy(deadline_ms: float, duration_s: float, limit: int = 2) -> AdmissionController:
    """A surface whose requests have taken ``duration_s``, ``limit`` just admitted at 6 s."""
    c = AdmissionController([surf("agent", 2, limit, 100, deadline_ms), surf("tab", 0, 4, 4, 250)])
    for i in range(3):
        ticket = c.try_admit("agent", float(i))
        assert isinstance(ticket, Ticket)
        c.release(ticket, "completed", i + duration_s)
    for _ in range(limit):
        assert isinstance(c.try_admit("agent", 6.0), Ticket)
    return c


def test_a_request_that_cannot_be_served_by_its_deadline_is_rejected_at_once() -> None:
    c = _busy(deadline_ms=2500, duration_s=1.0)  # two slots, each free in 1 s, then every 1 s
    now = 6.0
    queued = [c.try_admit("agent", now) for _ in range(4)]  # waits of 1, 1, 2 and 2 s: inside 2.5 s
    assert all(isinstance(q, Queued) for q in queued)
    r = c.try_admit("agent", now)  # 3 s away
    assert isinstance(r, Rejection) and r.reason == "predicted_wait"
    assert isinstance(r.error, RateLimited) and r.error.status_code == 429
    assert r.error.retry_after_s == pytest.approx(3.0)
    n = c.counters("agent")
    assert (n.rejected_predicted, n.queued, n.waiting, n.rejected_deadline) == (1, 4, 4, 0)
    assert n.balanced()
    # Another surface with room is not affected.
    assert isinstance(c.try_admit("tab", now), Ticket)


def test_without_an_estimate_a_request_queues_and_its_deadline_bounds_the_wait() -> None:
    c = AdmissionController([surf("agent", 2, 1, 10, 1000)])
    assert isinstance(c.try_admit("agent", 0.0), Ticket)
    assert isinstance(c.try_admit("agent", 0.0), Queued)  # no completion yet: no prediction
    assert c.predicted_wait_s("agent", 0.0) is None
    assert [r.reason for r in c.expire(1.0)] == ["deadline"]


def test_503_when_every_surface_is_blocked_and_cannot_queue_usefully() -> None:
    c = _busy(deadline_ms=500, duration_s=1.0)  # agent: a new waiter is 1 s away
    for _ in range(4):
        assert isinstance(c.try_admit("tab", 6.0), Ticket)
    for _ in range(4):
        assert isinstance(c.try_admit("tab", 6.0), Queued)  # tab: at its limit, queue full
    r = c.try_admit("agent", 6.0)
    assert isinstance(r, Rejection) and r.reason == "predicted_wait"
    assert isinstance(r.error, Overloaded) and r.error.status_code == 503
    assert c.saturated(6.0) and not c.saturated()  # the queue-full-only view disagrees


async def test_the_async_wrapper_raises_without_queueing() -> None:
    c = _busy(deadline_ms=1500, duration_s=1.0)
    adm = AsyncAdmission(c, clock=lambda: 6.0)
    assert all(isinstance(c.try_admit("agent", 6.0), Queued) for _ in range(2))  # 1 s each: fits
    with pytest.raises(RateLimited) as exc:
        await adm.acquire("agent")  # 2 s: rejected before any future is made
    assert exc.value.retry_after_s == pytest.approx(2.0)
    assert adm.pending() == 0 and c.counters("agent").rejected_predicted == 1
    adm.close()


def test_the_precheck_refuses_only_what_try_admit_would_refuse_whatever_was_asked() -> None:
    c = _busy(deadline_ms=2500, duration_s=1.0)  # agent at its limit of 2, a waiter 1 s away
    assert c.precheck("tab", 6.0) is None  # tab has room: go on
    assert c.precheck("agent", 6.0) is None  # agent can still queue usefully
    for _ in range(4):
        assert isinstance(c.try_admit("agent", 6.0), Queued)  # waits of 1, 1, 2, 2 s
    r = c.precheck("agent", 6.0)
    assert isinstance(r, Rejection) and r.reason == "predicted_wait" and r.error.retry_after_s == 3.0
    assert c.try_admit("agent", 6.0).reason == "predicted_wait"  # type: ignore[union-attr]
    assert c.counters("agent").rejected_predicted == 2 and c.counters().balanced()


def test_the_precheck_also_refuses_when_every_backend_is_full_below_the_surfaces_limit() -> None:
    """A shared pool's Agent surface allows more than its backends hold: with every backend full a
    new request would queue whatever it named, so a wait past its deadline (or a full queue) is
    refused before its body is parsed and tokenized, as try_admit would refuse it after."""
    c = AdmissionController([surf("agent", 2, 16, 3, 2500), surf("tab", 0, 4, 4, 250)], {"pool": 2})
    for i in range(3):  # requests of 1 s each
        ticket = c.try_admit("agent", float(i), ["pool"])
        assert isinstance(ticket, Ticket)
        c.release(ticket, "completed", i + 1.0)
    for _ in range(2):  # the pool full at 6 s, the surface at 2 of its 16
        assert isinstance(c.try_admit("agent", 6.0, ["pool"]), Ticket)
    assert c.precheck("agent", 6.0) is None  # it can still queue usefully
    for _ in range(3):
        assert isinstance(c.try_admit("agent", 6.0, ["pool"]), Queued)  # waits of 1, 1, 2 s
    r = c.precheck("agent", 6.0)
    assert isinstance(r, Rejection) and r.reason == "queue_full"
    assert c.try_admit("agent", 6.0, ["pool"]).reason == "queue_full"  # type: ignore[union-attr]
    assert c.precheck("tab", 6.0) is None  # the same full pool: tab's own queue is empty
    roomy = AdmissionController([surf("agent", 2, 16, 3, 2500)], {"pool": 2, "api": None})
    for _ in range(2):
        assert isinstance(roomy.try_admit("agent", 0.0, ["pool"]), Ticket)
    for _ in range(3):
        assert isinstance(roomy.try_admit("agent", 0.0, ["pool"]), Queued)
    assert roomy.precheck("agent", 0.0) is None  # an uncapped backend has room: try_admit decides
    assert c.counters("agent").balanced() and roomy.counters("agent").balanced()


def test_the_precheck_refuses_a_wait_past_the_deadline_on_a_full_backend() -> None:
    c = AdmissionController([surf("agent", 2, 16, 100, 2500)], {"pool": 2})
    for i in range(3):
        ticket = c.try_admit("agent", float(i), ["pool"])
        assert isinstance(ticket, Ticket)
        c.release(ticket, "completed", i + 1.0)
    for _ in range(2):
        assert isinstance(c.try_admit("agent", 6.0, ["pool"]), Ticket)
    for _ in range(4):
        assert isinstance(c.try_admit("agent", 6.0, ["pool"]), Queued)  # waits of 1, 1, 2, 2 s
    r = c.precheck("agent", 6.0)
    assert isinstance(r, Rejection) and r.reason == "predicted_wait" and r.error.retry_after_s == 3.0
    assert c.counters("agent").rejected_predicted == 1


def test_deadline_expiries_are_split_by_whether_the_waiter_had_a_wait_estimate() -> None:
    c = AdmissionController([surf("agent", 2, 1, 10, 1000), surf("tab", 0, 4, 4, 250)])
    assert isinstance(c.try_admit("agent", 0.0), Ticket)  # holds the one slot: no estimate yet
    cold = c.try_admit("agent", 0.0)
    assert isinstance(cold, Queued)
    assert [r.entry_id for r in c.expire(1.0)] == [cold.id]
    n = c.counters("agent")
    assert (n.rejected_deadline, n.deadline_unestimated) == (1, 1) and n.balanced()
    warm = _busy(deadline_ms=1000, duration_s=5.0, limit=1)  # an estimate: 5 s per request
    w = warm.try_admit("agent", 6.0)
    assert isinstance(w, Rejection)  # 5 s away: rejected at once, not queued
    warm2 = _busy(deadline_ms=1000, duration_s=0.5, limit=1)  # 0.5 s per request: it queues...
    q = warm2.try_admit("agent", 6.0)
    assert isinstance(q, Queued)
    assert [r.entry_id for r in warm2.expire(7.0)] == [q.id]  # ...and the slot never came
    m = warm2.counters("agent")
    assert (m.rejected_deadline, m.deadline_unestimated) == (1, 0) and m.balanced()


def test_a_predicted_wait_past_most_of_the_deadline_is_refused_at_once() -> None:
    """WAIT_SHARE: a waiter whose slot is predicted at 90 % of its deadline would sit at the edge of
    the queue, where any error in the estimate makes it wait the deadline out; it gets its 429 now."""
    c = _busy(deadline_ms=2200, duration_s=1.0)  # two slots: waits of 1, 1, 2, 2 s
    queued = [c.try_admit("agent", 6.0) for _ in range(2)]  # 1 s: under 0.8 x 2.2 = 1.76 s
    assert all(isinstance(q, Queued) for q in queued)
    r = c.try_admit("agent", 6.0)  # 2 s: inside the 2.2 s deadline, past 80 % of it
    assert isinstance(r, Rejection) and r.reason == "predicted_wait"
    assert r.error.retry_after_s == pytest.approx(2.0)
