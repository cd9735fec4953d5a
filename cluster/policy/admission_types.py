"""What admission hands out and counts (:mod:`cluster.policy.admission`): tickets, waiters, rejections and
the exactly-once counters. Plain values, so the gateway, the status page and tests share them.

Accounting is exactly-once: each admitted ticket is released once as completed, errored or
cancelled; a second release (or a foreign ticket) changes nothing and is counted in
``double_release``. :meth:`Counters.balanced` checks ``admitted == completed + errored + cancelled
+ in_flight`` and ``queued == admitted_after_wait + rejected_deadline + rejected_unreachable +
pushed_out + abandoned + waiting``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Literal

from cluster.wire.errors import ClusterError, Overloaded, RateLimited

RejectReason = Literal["queue_full", "deadline", "predicted_wait", "guard", "pushed_out"]


class Outcome(StrEnum):
    COMPLETED = "completed"
    ERRORED = "errored"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: it holds a surface slot and, when ``backend`` is set, a backend slot."""

    id: int
    surface: str
    backend: str | None
    enqueued_at: float
    admitted_at: float

    @property
    def waited_s(self) -> float:
        return self.admitted_at - self.enqueued_at


@dataclass(frozen=True, slots=True)
class Queued:
    """A waiter: admitted later by a release (returned from it), or rejected by :meth:`expire`."""

    id: int
    surface: str
    enqueued_at: float
    deadline: float
    ahead: int  # waiters of its surface already queued when it arrived


@dataclass(frozen=True, slots=True)
class Rejection:
    error: ClusterError  # RateLimited (429) or Overloaded (503), with retry_after_s
    surface: str
    reason: RejectReason
    entry_id: int | None = None  # the Queued id for deadline rejections


@dataclass(slots=True)
class Counters:
    admitted: int = 0  # immediately or after waiting
    admitted_after_wait: int = 0
    queued: int = 0
    completed: int = 0
    errored: int = 0
    cancelled: int = 0  # admitted, then cancelled (client gone)
    rejected_queue_full: int = 0
    rejected_deadline: int = 0
    deadline_unestimated: int = 0  # of rejected_deadline: queued while there was no wait estimate
    rejected_predicted: int = 0  # at once: the predicted wait exceeded the queue deadline
    rejected_unreachable: int = 0  # waiters rejected early: a lowered guard cap put them past it
    rejected_guard: int = 0  # at once: the SLO guard holds the surface off every candidate backend
    pushed_out: int = 0  # waiters refused to make room for a tenant with a smaller share of the queue
    rejected_overloaded: int = 0  # of the six above, those answered 503 (cluster saturated)
    abandoned: int = 0  # waiters that left before admission
    double_release: int = 0
    in_flight: int = 0
    waiting: int = 0

    def balanced(self) -> bool:
        ended = self.completed + self.errored + self.cancelled
        left_queue = (
            self.admitted_after_wait
            + self.rejected_deadline
            + self.rejected_unreachable
            + self.pushed_out
            + self.abandoned
        )
        return self.admitted == ended + self.in_flight and self.queued == left_queue + self.waiting

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def rejection_error(
    reason: RejectReason,
    surface: str,
    retry_s: float,
    saturated: bool,
    limit: int,
    waiting: int,
    deadline_s: float,
) -> ClusterError:
    """What the client is told: 503 when the whole cluster is saturated, else a 429 that says why."""
    if saturated:
        return Overloaded(
            "the cluster is saturated: every surface is blocked with a full queue", retry_after_s=retry_s
        )
    if reason == "predicted_wait":
        why = f"a slot is {retry_s:.1f} s away, past the queue deadline of {deadline_s * 1000:.0f} ms"
        return RateLimited(f"surface '{surface}': {why}", retry_after_s=retry_s)
    if reason == "guard":
        return RateLimited(
            f"surface '{surface}' is deferred: a higher-priority surface is near its latency objective "
            f"on every backend this request could use; retry in {retry_s:.1f} s",
            retry_after_s=retry_s,
        )
    if reason == "pushed_out":
        return RateLimited(
            f"surface '{surface}' is full and this request's place in its queue went to a tenant with a "
            f"smaller share of it; retry in {retry_s:.1f} s",
            retry_after_s=retry_s,
        )
    if reason == "queue_full":
        return RateLimited(
            f"surface '{surface}' is at its limit of {limit} requests with {waiting} waiting",
            retry_after_s=retry_s,
        )
    why = f"no slot within the queue deadline of {deadline_s * 1000:.0f} ms"
    return RateLimited(f"surface '{surface}': {why}", retry_after_s=retry_s)
