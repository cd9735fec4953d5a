"""Fast, honest rejects: a request whose predicted queue wait exceeds its deadline gets its 429 (or
the cluster's 503) at once, with the prediction as Retry-After, instead of waiting the deadline out."""

from __future__ import annotations

from collections import deque

import pytest

from cluster.admission import AdmissionController, AsyncAdmission, Queued, Rejection, Ticket
from cluster.config import SurfaceConfig
from cluster.errors import Overloaded, RateLimited
from cluster.queue_wait import completion_rate, predict_wait


def surf(name: str, priority: int, conc: int, queue: int, deadline_ms: float) -> SurfaceConfig:
    return SurfaceConfig(
        name=name, priority=priority, max_concurrency=conc, max_queue=queue, queue_deadline_ms=deadline_ms
    )


def test_rate_is_counted_over_the_span_of_recent_completions() -> None:
    done = deque([1.0, 2.0, 3.0, 4.0])
    assert completion_rate(done, 5.0, 10.0, 3) == pytest.approx(4 / 4.0)
    assert completion_rate(deque([1.0, 2.0]), 5.0, 10.0, 3) is None  # too few to tell
    old = deque([0.0, 1.0, 2.0, 50.0])
    assert completion_rate(old, 51.0, 10.0, 1) == pytest.approx(1 / 1.0) and list(old) == [50.0]
    est = predict_wait(4, deque([1.0, 2.0, 3.0, 4.0]), 5.0)
    assert est is not None and est.wait_s == pytest.approx(5 / 1.0)


def _busy(deadline_ms: float, completions_per_s: float, limit: int = 2) -> AdmissionController:
    """A surface at its limit whose requests have been ending at ``completions_per_s``."""
    c = AdmissionController([surf("agent", 2, limit, 100, deadline_ms), surf("tab", 0, 4, 4, 250)])
    t = 0.0
    for _ in range(6):
        ticket = c.try_admit("agent", t)
        assert isinstance(ticket, Ticket)
        c.release(ticket, "completed", t)  # at 0, 1, ..., 5 s (for 1 per second); now is 6 s
        t += 1 / completions_per_s
    for _ in range(limit):
        assert isinstance(c.try_admit("agent", t), Ticket)
    return c


def test_a_request_that_cannot_be_served_by_its_deadline_is_rejected_at_once() -> None:
    c = _busy(deadline_ms=3000, completions_per_s=1.0)
    now = 6.0
    queued = [c.try_admit("agent", now) for _ in range(3)]  # waits of 1, 2 and 3 s: inside 3 s
    assert all(isinstance(q, Queued) for q in queued)
    r = c.try_admit("agent", now)  # 4 s away
    assert isinstance(r, Rejection) and r.reason == "predicted_wait"
    assert isinstance(r.error, RateLimited) and r.error.status_code == 429
    assert r.error.retry_after_s == pytest.approx(4.0)
    n = c.counters("agent")
    assert (n.rejected_predicted, n.queued, n.waiting, n.rejected_deadline) == (1, 3, 3, 0)
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
    c = _busy(deadline_ms=500, completions_per_s=1.0)  # agent: a new waiter is 1 s away
    for _ in range(4):
        assert isinstance(c.try_admit("tab", 6.0), Ticket)
    for _ in range(4):
        assert isinstance(c.try_admit("tab", 6.0), Queued)  # tab: at its limit, queue full
    r = c.try_admit("agent", 6.0)
    assert isinstance(r, Rejection) and r.reason == "predicted_wait"
    assert isinstance(r.error, Overloaded) and r.error.status_code == 503
    assert c.saturated(6.0) and not c.saturated()  # the queue-full-only view disagrees


async def test_the_async_wrapper_raises_without_queueing() -> None:
    c = _busy(deadline_ms=2000, completions_per_s=1.0)
    adm = AsyncAdmission(c, clock=lambda: 6.0)
    queued = c.try_admit("agent", 6.0)
    assert isinstance(queued, Queued)  # 1 s: fits
    c.try_admit("agent", 6.0)  # 2 s: fits
    with pytest.raises(RateLimited) as exc:
        await adm.acquire("agent")  # 3 s: rejected before any future is made
    assert exc.value.retry_after_s == pytest.approx(3.0)
    assert adm.pending() == 0 and c.counters("agent").rejected_predicted == 1
    adm.close()
