"""Start-time fair queuing inside one surface's queue (:mod:`cluster.policy.admission`), and what it
means for a newcomer: how many waiters go before it, and whom it pushes out of a full queue.

Each tenant has a virtual time (``vtime``): the start tag of its next request. Admitting a request
of tenant ``t`` at tag ``T`` moves the surface's clock (``vclock``) to ``T`` and ``vtime[t]`` to
``T + 1 / weight(t)``. So the ``j``-th waiter of ``t`` (0 first) starts at
``max(vtime[t], vclock) + j / weight(t)``, and the queue drains in tag order (the oldest first on a
tie). A waiter without a tenant starts at ``vclock``: it has no share of its own and goes by age.

Two consequences the admission controller uses, so that a tenant's runaway loop cannot starve
another tenant of its surface even before its budget refuses it:

* a newcomer's place (:func:`ahead_of`) is the number of waiters whose tag is not after its own,
  not the queue's length: a light tenant behind a heavy tenant's backlog waits for its share, and
  its predicted wait says so;
* a full queue (:func:`push_out`) takes the newcomer in place of the waiter with the latest tag
  when that tag is after the newcomer's: the heavy tenant's newest waiter is refused (429 with
  ``Retry-After``) instead of the light tenant's first.

Pure: plain values in, plain values out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


class Waiter(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def tenant(self) -> str | None: ...


def start_tag(
    tenant: str | None, j: int, vtime: Mapping[str, float], vclock: float, weights: Mapping[str, float]
) -> float:
    """The start tag of ``tenant``'s ``j``-th waiter (0: its next to be admitted)."""
    if tenant is None:
        return vclock
    return max(vtime.get(tenant, 0.0), vclock) + j / weights.get(tenant, 1.0)


def tags(
    queue: Iterable[Waiter], vtime: Mapping[str, float], vclock: float, weights: Mapping[str, float]
) -> tuple[list[tuple[float, int]], dict[str | None, int]]:
    """Each waiter's (start tag, id) in queue order, and how many each tenant has queued."""
    count: dict[str | None, int] = {}
    out = []
    for w in queue:
        j = count.get(w.tenant, 0)
        count[w.tenant] = j + 1
        out.append((start_tag(w.tenant, j, vtime, vclock, weights), w.id))
    return out, count


def ahead_of(
    tenant: str | None,
    queue: Iterable[Waiter],
    vtime: Mapping[str, float],
    vclock: float,
    weights: Mapping[str, float],
) -> int:
    """How many of the queued would be admitted before a newcomer of ``tenant``."""
    got, count = tags(queue, vtime, vclock, weights)
    mine = start_tag(tenant, count.get(tenant, 0), vtime, vclock, weights)
    return sum(1 for tag, _ in got if tag <= mine)


def push_out(
    tenant: str | None,
    queue: Iterable[Waiter],
    vtime: Mapping[str, float],
    vclock: float,
    weights: Mapping[str, float],
) -> int | None:
    """The id of the waiter a newcomer of ``tenant`` takes the place of in a full queue: the one
    with the latest start tag (the newest of a tie), if that tag is after the newcomer's; else None
    (the newcomer is the one refused). A newcomer without a tenant has no share to claim: None."""
    got, count = tags(queue, vtime, vclock, weights)
    if not got or tenant is None:
        return None
    mine = start_tag(tenant, count.get(tenant, 0), vtime, vclock, weights)
    tag, wid = max(got)
    return wid if tag > mine else None
