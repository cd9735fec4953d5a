"""How long a new waiter would wait: the estimate behind admission's fast, honest rejects.

A request that joins a surface's queue behind ``ahead`` others gets a slot when the
``ahead + 1``-th slot of that surface frees (whatever binds it: the surface's limit, a backend cap,
or the SLO guard's cap on lower-priority work, its slots come back as its own requests end). Each
of the surface's requests in flight is expected to end after the surface's recent mean request
duration ``D``, so a slot frees at ``max(0, D - elapsed)`` for each request in flight, and then
every ``D`` again as the waiters before this one take it and end in turn. When that time exceeds
the queue deadline, the request would only wait the deadline out and then get a 429: admission
answers the 429 at once instead, with the estimate as ``Retry-After``.

Durations, not a completion rate: requests admitted together end together, and a rate counted
over such bursts overstates how soon the next slot frees. With fewer than ``min_samples`` recent
durations, or nothing of the surface in flight, there is no estimate: the request queues and its
deadline still bounds the wait. Pure: ``now`` and the samples are passed in.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    wait_s: float  # predicted time until a slot
    mean_duration_s: float  # the recent mean request duration it was computed from


class DurationWindow:
    """The surface's recent request durations (admitted → ended), at most ``maxlen`` of the last
    ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0, maxlen: int = 64) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)  # (ended at, duration)

    def add(self, ended_at: float, duration_s: float) -> None:
        self._samples.append((ended_at, max(0.0, duration_s)))

    def mean(self, now: float, min_samples: int) -> float | None:
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()
        if len(self._samples) < min_samples:
            return None
        return sum(d for _, d in self._samples) / len(self._samples)


def predict_wait(
    ahead: int,
    elapsed_in_flight: Iterable[float],
    durations: DurationWindow,
    now: float,
    *,
    min_samples: int = 3,
) -> WaitEstimate | None:
    """The wait of a waiter joining behind ``ahead`` others, given how long each of the surface's
    requests in flight has run; None when there is no estimate."""
    mean = durations.mean(now, min_samples)
    frees = [max(0.0, mean - e) for e in elapsed_in_flight] if mean is not None else []
    if mean is None or not frees:
        return None
    heapq.heapify(frees)
    for _ in range(ahead):  # each waiter ahead takes the next free slot and holds it for ``mean``
        heapq.heapreplace(frees, frees[0] + mean)
    return WaitEstimate(frees[0], mean)
